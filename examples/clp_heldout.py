"""Held-out top-1 of CLP heads while (or after) ``mlx-mtp train clp`` trains
them: the heads of the run's last checkpoint (no span predictor needed),
teacher forced on the backbone's own greedy continuations of prompts the
training never saw, GSM8K's test split and Spec-Bench's evaluation prompts
(the issue's held-out check; docs/methods.md, clp).

    python examples/clp_heldout.py --model qwen2.5-coder-0.5b \\
        --out /path/to/qwen2.5-coder-0.5b-gsm8k [--gsm8k-test test.jsonl] [--limit 24]

``--out`` is the heads folder the training run writes; its checkpoints are in
``OUT/../.NAME.train``. Prints (and with ``--json`` writes) top-1 per head
offset (n+2, n+3, ...) and the positions scored.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: loads OpenBLAS ahead of mlx on Linux)

# isort: split
import mlx.optimizers as optim

from mlx_mtp.clp_format import CLPHeads, base_config, gate_hidden_for
from mlx_mtp.confadapt_format import tokenizer_eos_ids
from mlx_mtp.data import read_prompts, render_prompt, spec_bench_sample
from mlx_mtp.families import model_parts
from mlx_mtp.loading import load_model
from mlx_mtp.training import clp as train
from mlx_mtp.training.continuations import greedy_continuations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", required=True, help="the training run's heads folder (--out)")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--bottleneck", type=int, default=256)
    ap.add_argument("--gsm8k-test", default=None, help="GSM8K test jsonl")
    ap.add_argument("--limit", type=int, default=24, help="GSM8K test questions")
    ap.add_argument("--per-task", type=int, default=4, help="Spec-Bench prompts per task")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    lm = load_model(args.model, dtype="float32")
    model, tok = lm.model, lm.tokenizer
    _, lm_head, embed = model_parts(model)
    config = base_config(
        model, lm.name, args.k, "resblock", bottleneck=args.bottleneck,
        gate_hidden=gate_hidden_for(model.args.hidden_size, args.k),
    )  # fmt: skip
    heads = CLPHeads(config)
    state = train._load_ckpt(train.checkpoint_dir(Path(args.out)), heads, optim.AdamW(1e-3))
    if state is None:
        raise SystemExit(f"no head checkpoint for {args.out}: train clp writes one every 200 steps")
    eos = set(tokenizer_eos_ids(tok))
    sets = [("spec-bench", [q["turns"][0] for q in spec_bench_sample(args.per_task)])]
    if args.gsm8k_test:
        sets.insert(0, ("gsm8k-test", read_prompts(args.gsm8k_test, limit=args.limit)))
    result = {"model": args.model, "checkpoint_step": state["step"], "max_tokens": args.max_tokens}
    for name, texts in sets:
        prompts = [render_prompt(tok, [{"role": "user", "content": t}])[-256:] for t in texts]
        seqs = greedy_continuations(model, prompts, args.max_tokens, eos, 8, True, False)
        H, nxt, tgt, valid = train.examples(seqs, args.k)
        pred = train.head_predictions(heads, lm_head, embed, H, nxt)
        top1 = [
            float(((pred[:, j] == tgt[:, j]) & valid[:, j]).sum() / max(valid[:, j].sum(), 1))
            for j in range(args.k)
        ]
        result[name] = {"prompts": len(prompts), "positions": int(len(H)), "top1": top1}
        print(name, result[name], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
