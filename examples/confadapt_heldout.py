"""Check an MTP adapter in a minute, before the long decoding evaluation
(``mlx_mtp.training.mtp_check``, which ``mlx-mtp train mtp`` runs at the end
on six prompts).

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

    from mlx_mtp.cache_view import install_positional_rope
    from mlx_mtp.commands.confadapt import resolve_data
    from mlx_mtp.confadapt_format import apply_adapter, read_adapter_config, tokenizer_eos_ids
    from mlx_mtp.data import spec_bench_sample
    from mlx_mtp.loading import load_model
    from mlx_mtp.training.continuations import greedy_continuations
    from mlx_mtp.training.mtp import encode_prompt
    from mlx_mtp.training.mtp_check import check_lines, heldout_check

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
        result = heldout_check(
            model, int(cfg["mask_token_id"]), prompts, conts, args.k, args.stride, taus, True
        )
        tr = cfg.get("training", {})
        print(
            f"\n== {folder} (gated {cfg['lora'].get('gated', False)}, lr {tr.get('lr')}, "
            f"steps {tr.get('steps_done')}, regions {tr.get('regions')})"
        )
        print("\n".join(check_lines(result, f"{len(prompts)} prompts")))


if __name__ == "__main__":
    main()
