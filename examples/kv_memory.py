"""Peak memory of a generation with and without a quantized KV cache.

For each context length and ``kv_bits`` (none, 8, 4): an ``ntp`` binding
prefills a prompt of that many tokens and generates ``--new`` tokens; its
peak (``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``, the
weights included as loaded before the reset) is the prefill's peak. Then
each method (ntp, probe BC 10, probe BC 30) decodes ``--new`` tokens from
that same prefilled cache (handed from binding to binding, so the prompt is
prefilled once per context and ``kv_bits``), its peak reset before: the
decoding peak. A user's peak is the larger of the two. The KV cache's own
bytes (``nbytes`` of its arrays) are printed beside. With
``--quantize-after-prefill`` a quantized row prefills a full-precision
cache and quantizes it (``KVCache.to_quantized``, as mlx-lm's
``--quantized-kv-start`` does) before the methods decode; its prefill peak
is then the full cache's, printed as "-". Prefilling into a quantized cache
from the first token is slow on a CPU at long contexts. Markdown table:

    python examples/kv_memory.py --model qwen2.5-coder-1.5b --dtype float32 --contexts 2048 8192
"""

from __future__ import annotations

import argparse
import gc
import platform
import time

# isort: off
import mlx_mtp  # noqa: F401  (first: it loads OpenBLAS before mlx on Linux)

# isort: on
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_mtp.decoding import generate_steps
from mlx_mtp.loading import load_model

ROWS = [
    ("ntp", "ntp", {}),
    ("probe BC 10", "probe", {"bc": 10}),
    ("probe BC 30", "probe", {"bc": 30}),
]


def kv_bytes_of(c) -> int:
    """Bytes of the arrays of one layer's KV cache ``c``."""
    total = 0
    for a in (c.keys, c.values):
        for x in a if isinstance(a, (tuple, list)) else [a]:
            total += x.nbytes if x is not None else 0
    return total


def peak_of(m, prompt: list[int], new: int) -> float:
    """GB at the peak of one generation of binding ``m``."""
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    for _ in generate_steps(m.ctx, m.method, prompt, max_tokens=new):
        pass
    return mx.get_peak_memory() / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--new", type=int, default=16, help="new tokens per generation")
    ap.add_argument("--kv-bits", nargs="+", default=["none", "8", "4"],
                    help="rows: none, 8, 4")  # fmt: skip
    ap.add_argument("--quantize-after-prefill", action="store_true",
                    help="quantized rows: prefill in full precision, then quantize")  # fmt: skip
    args = ap.parse_args()
    loaded = load_model(args.model, dtype=args.dtype)
    weights = mx.get_active_memory() / 1e9
    print(
        f"{args.model} {args.dtype} (weights {weights:.2f} GB), {platform.machine()} "
        f"{mx.default_device()}, {args.new} new tokens; GB (mx.get_peak_memory)\n"
    )
    labels = " | ".join(f"decode {label}" for label, _, _ in ROWS)
    print(f"| context | KV cache | KV bytes | prefill peak | {labels} | seconds |")
    print("|---|---|---|---|" + "---|" * len(ROWS) + "---|")
    base = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    for context in args.contexts:
        prompt = (base * (context // len(base) + 1))[:context]
        for bits in (None if b == "none" else int(b) for b in args.kv_bits):
            t0 = time.perf_counter()
            after = args.quantize_after_prefill and bits is not None
            first = loaded.bind("ntp", kv_bits=None if after else bits)
            prefill = peak_of(first, prompt, args.new)
            cache, cached = first.engine.cache, first.engine.cached
            if after:
                cache = [
                    c.to_quantized(group_size=64, bits=bits) if type(c) is KVCache else c
                    for c in cache
                ]
                mx.eval([c.state for c in cache])
            held = sum(kv_bytes_of(c) for c in cache) / 1e9
            first.engine.cache, first.engine.cached = [], []
            del first
            decode = []
            for _, method, opts in ROWS:
                m = loaded.bind(method, kv_bits=bits, **opts)
                # the prefilled cache moves to this binding: same model, same
                # kv_bits, so the same cache layout; its prompt is reused whole
                m.engine.cache, m.engine.cached = cache, cached
                decode.append(peak_of(m, prompt, args.new))
                cache, cached = m.engine.cache, m.engine.cached
                m.engine.cache, m.engine.cached = [], []
                del m
            kind = "full" if bits is None else f"{bits}-bit"
            cells = " | ".join(f"{d:.3f}" for d in decode)
            pre = "-" if after else f"{prefill:.3f}"
            print(
                f"| {context} | {kind} | {held:.3f} | {pre} | {cells} | "
                f"{time.perf_counter() - t0:.0f} |",
                flush=True,
            )
            del cache, cached
            gc.collect()
            mx.clear_cache()


if __name__ == "__main__":
    main()
