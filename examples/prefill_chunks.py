"""Prefill time of a long prompt by chunk size (the prefill step).

Prefills ``--tokens`` tokens of Spec-Bench summarization and RAG prompts
(one after another) through the backbone in chunks of each ``--steps``
size, each chunk's cache evaluated before the next (as ``Engine.sync`` and
mlx-lm's ``generate_step`` do), alternating the sizes for ``--rounds``
rounds, and prints the seconds of each. The package's default
(``mlx_mtp.engine.PREFILL_STEP``) is 2048 on a GPU and 512 on MLX's CPU
backend, from this script's figures.

    .venv/bin/python examples/prefill_chunks.py [--model smollm2-135m] \\
        [--tokens 1500] [--steps 2048,1024,512,256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

from batch_agreement import spec_prompts

from mlx_mtp.engine import PREFILL_STEP
from mlx_mtp.loading import load_model


def main() -> None:
    """Print each chunk size's prefill time, round by round."""
    import mlx.core as mx  # after mlx_mtp: the BLAS MLX uses on Linux
    from mlx_lm.models.cache import make_prompt_cache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--steps", default="2048,1024,512,256")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    lm = load_model(args.model, "float32")
    texts = spec_prompts(lm.tokenizer, 12, 2000, ("summarization", "rag"))
    text = [t for p in texts for t in p]
    tokens = (text * (args.tokens // len(text) + 1))[: args.tokens]
    steps = [int(s) for s in args.steps.split(",")]
    print(f"{args.model} float32, {len(tokens)} prompt tokens, {mx.default_device()}, "
          f"default prefill step {PREFILL_STEP}")  # fmt: skip
    for r in range(args.rounds):
        for step in steps:
            cache = make_prompt_cache(lm.model)
            t = time.perf_counter()
            for s in range(0, len(tokens), step):
                lm.model.model(mx.array(tokens[s : s + step])[None], cache=cache)
                mx.eval([c.state for c in cache])
            print(f"round {r + 1}, chunks of {step:5d}: {time.perf_counter() - t:6.2f} s")


if __name__ == "__main__":
    main()
