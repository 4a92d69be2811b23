"""Peak memory of a generation with and without a quantized KV cache.

For each context length, method and ``kv_bits``: a fresh binding prefills a
prompt of that many tokens and generates ``--new`` tokens; the peak is
``mx.get_peak_memory()`` after ``mx.reset_peak_memory()`` (weights included,
as loaded before the reset), printed as a markdown table.

    python examples/kv_memory.py --model smollm2-135m --dtype float32 --contexts 2048 8192
"""

from __future__ import annotations

import argparse
import gc
import platform

import mlx.core as mx

import mlx_mtp  # noqa: F401  (OpenBLAS before mlx on Linux)
from mlx_mtp.decoding import generate_steps
from mlx_mtp.loading import load_model

ROWS = [
    ("ntp", "ntp", {}),
    ("probe BC 10", "probe", {"bc": 10}),
    ("probe BC 30", "probe", {"bc": 30}),
]


def peak_gb(loaded, method, opts, bits, context, new) -> float:
    m = loaded.bind(method, kv_bits=bits, **opts)
    # a prompt of ``context`` tokens: the tokenizer's ids of a repeated text
    base = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    prompt = (base * (context // len(base) + 1))[:context]
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    for _ in generate_steps(m.ctx, m.method, prompt, max_tokens=new):
        pass
    peak = mx.get_peak_memory() / 1e9
    del m
    gc.collect()
    mx.clear_cache()
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--new", type=int, default=16, help="new tokens per generation")
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    weights = mx.get_active_memory() / 1e9
    print(
        f"{args.model} {args.dtype} (weights {weights:.2f} GB), {platform.machine()} "
        f"{mx.default_device()}, {args.new} new tokens; peak GB (mx.get_peak_memory)\n"
    )
    print("| context | method | full KV | 8-bit KV | 4-bit KV |")
    print("|---|---|---|---|---|")
    for ctx in args.contexts:
        for label, method, opts in ROWS:
            cells = [peak_gb(loaded, method, opts, b, ctx, args.new) for b in (None, 8, 4)]
            row = " | ".join(f"{c:.3f}" for c in cells)
            print(f"| {ctx} | {label} | {row} |", flush=True)


if __name__ == "__main__":
    main()
