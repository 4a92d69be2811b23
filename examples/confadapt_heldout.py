"""Check an MTP adapter in a minute, before the long decoding evaluation.

Teacher-forced on the un-adapted model's greedy continuations of held-out
prompts (GSM8K test questions and/or the 48 Spec-Bench prompts), one forward
pass per prompt per adapter:

- NTP agreement: share of continuation positions where the adapted model's
  argmax equals the un-adapted model's greedy token. Below 1.0 the adapter has
  moved next-token prediction; every disagreement can start a divergent output.
- mask accuracy by slot: after anchors every ``--stride`` positions, k-1 mask
  tokens (as in ConfAdapt decoding); slot s is right if its argmax equals the
  greedy token at anchor + 1 + s.
- ConfAdapt proxy at each tau: the block ConfAdapt would emit at that anchor
  (leading positions with top-1 probability >= tau, at least one; Kirchenbauer
  et al. §3) -- mean length (an Eff. k estimate) and the share of emitted
  tokens that equal the greedy reference.

Usage::

    python examples/confadapt_heldout.py --adapter mlx_mtp/assets/confadapt/smollm2-135m-gsm8k \
        --adapter /tmp/other-adapter --gsm8k 24 --spec 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: preloads OpenBLAS before mlx on Linux, docs/design.md §9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--adapter", action="append", required=True, help="adapter folder (repeat)")
    ap.add_argument("--gsm8k", type=int, default=24, help="GSM8K test questions (first N)")
    ap.add_argument("--spec", type=int, default=2, help="Spec-Bench prompts per task (6 tasks)")
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--stride", type=int, default=8)
    ap.add_argument("--taus", default="0.9,0.6")
    ap.add_argument("--cache", type=Path, default=None, help="keep the continuations in this file")
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from tqdm import tqdm

    from mlx_mtp.cache_view import install_positional_rope
    from mlx_mtp.commands.confadapt import resolve_data
    from mlx_mtp.confadapt_format import apply_adapter, read_adapter_config, tokenizer_eos_ids
    from mlx_mtp.data import spec_bench_sample
    from mlx_mtp.loading import load_model
    from mlx_mtp.methods.confadapt import confadapt_length
    from mlx_mtp.training.continuations import greedy_continuations
    from mlx_mtp.training.mtp import encode_prompt, forward_layout, region_layout

    taus = [float(t) for t in args.taus.split(",")]
    base = load_model(args.model)
    texts = []
    if args.gsm8k:
        test = resolve_data("gsm8k-train").with_name("test.jsonl")
        texts += [json.loads(x)["question"] for x in test.read_text().splitlines()[: args.gsm8k]]
    if args.spec:
        texts += [q["turns"][0] for q in spec_bench_sample(args.spec)]
    prompts = [encode_prompt(base.tokenizer, t, "chat") for t in texts]
    key = {"model": args.model, "prompts": prompts, "gen_tokens": args.gen_tokens}
    cached = json.loads(args.cache.read_text()) if args.cache and args.cache.is_file() else {}
    if cached.get("key") == key:
        conts = cached["continuations"]
    else:
        eos = set(tokenizer_eos_ids(base.tokenizer))
        seqs = greedy_continuations(base.model, prompts, args.gen_tokens, eos)
        conts = [s.generated for s in seqs]
        if args.cache:
            args.cache.write_text(json.dumps({"key": key, "continuations": conts}))

    for folder in args.adapter:
        cfg = read_adapter_config(Path(folder))
        model = apply_adapter(base.model, Path(folder), cfg)
        install_positional_rope(model)
        mask_id = int(cfg["mask_token_id"])
        k = args.k
        ntp_hit = ntp_n = 0
        slot_hit = np.zeros(k - 1)
        slot_n = np.zeros(k - 1)
        emit = {t: [0, 0, 0] for t in taus}  # blocks, emitted tokens, emitted right
        for prompt, cont in tqdm(list(zip(prompts, conts)), desc=Path(folder).name, leave=False):
            real = prompt + cont
            g0 = len(prompt)
            anchors = list(range(g0 - 1, len(real) - 1, args.stride))
            lay = region_layout(len(real), anchors, [k] * len(anchors))
            ids = mx.array(real + [mask_id] * lay.n_slots)
            logits = forward_layout(model, ids, lay).astype(mx.float32)
            if mask_id < logits.shape[-1]:  # input-only token, as in ConfAdapt.step
                logits[:, mask_id] = -mx.inf
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            arg = np.array(mx.argmax(logp, axis=-1))
            conf = np.array(mx.exp(mx.max(logp, axis=-1)))
            truth = np.array(real)
            rows = np.arange(g0 - 1, len(real) - 1)
            ntp_hit += int((arg[rows] == truth[rows + 1]).sum())
            ntp_n += len(rows)
            for p, st in zip(anchors, lay.slot_start):
                block_rows = [p] + [st + s for s in range(k - 1)]
                pos = [p + 1 + i for i in range(k)]
                ok = [
                    pos[i] < len(real) and arg[r] == truth[pos[i]] for i, r in enumerate(block_rows)
                ]
                valid = [q < len(real) for q in pos]
                for s in range(1, k):
                    if valid[s]:
                        slot_n[s - 1] += 1
                        slot_hit[s - 1] += ok[s]
                for t in taus:
                    n = confadapt_length(conf[block_rows], t)
                    n = min(n, sum(valid))
                    e = emit[t]
                    e[0] += 1
                    e[1] += n
                    e[2] += sum(ok[:n])
        tr = cfg.get("training", {})
        print(
            f"\n== {folder} (gated {cfg['lora'].get('gated', False)}, lr {tr.get('lr')}, "
            f"steps {tr.get('steps_done')}, regions {tr.get('regions')})"
        )
        print(f"NTP agreement {ntp_hit / ntp_n:.3f} ({ntp_n} positions, {len(prompts)} prompts)")
        acc = slot_hit / np.maximum(slot_n, 1)
        print("mask accuracy by slot 1..: " + " ".join(f"{a:.2f}" for a in acc[:8]))
        for t in taus:
            b, n, r = emit[t]
            print(f"tau {t:g}: Eff. k (proxy) {n / b:.2f}, emitted tokens right {r / n:.3f}")


if __name__ == "__main__":
    main()
