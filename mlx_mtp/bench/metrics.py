"""Benchmark metrics: pure functions of token lists, counters and timings.

Definitions (docs/benchmarks.md, "Metrics", repeats them):

- **tau** (acceptance length, "mean accepted tokens" in Spec-Bench): generated
  tokens / target forward passes, bonus token included. Plain decoding = 1.00.
  Aggregated over prompts as sum(tokens) / sum(forwards) (token-weighted).
- **forwards per token**: 1 / tau.
- **decode tokens/s**: generated tokens / decode time (prefill excluded).
  Aggregated as sum(tokens) / sum(decode time).
- **speedup** vs ``ntp``: aggregate decode tokens/s of the method divided by
  the aggregate decode tokens/s of ``ntp`` over the same (prompt, turn,
  repeat) entries. For lossless methods at temperature 0 both generate the
  same tokens, so this is the ratio of total decode times.
- **repetition rate** (n = 4): the share of the output's n-grams that already
  appeared earlier in the same output. Aggregated by pooling the counts.
- **exactness**: a lossless method's tokens equal ``ntp``'s token for token;
  a mismatch is reported with the index of the first differing token.
- **agreement**: the share of ``ntp``'s tokens a lossless method reproduces
  before its first differing token, pooled over prompts (below 1.0 only
  outside float32, where near-ties can break differently).
- **accuracy** (GSM8K): the last number in the output equals the number after
  ``####`` in the reference answer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

#: n-gram size of the repetition rate
REPETITION_N = 4

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def tau(tokens: int, forwards: int) -> float:
    """Tokens per forward pass (bonus included); 0.0 when there was no forward."""
    return tokens / forwards if forwards else 0.0


def repetition_counts(tokens: Sequence[int], n: int = REPETITION_N) -> tuple[int, int]:
    """(repeated n-grams, total n-grams) of one output.

    An n-gram counts as repeated when the same n tokens already occurred at an
    earlier start position of the same output (overlaps allowed).
    """
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    total = max(len(tokens) - n + 1, 0)
    for i in range(total):
        g = tuple(tokens[i : i + n])
        if g in seen:
            repeated += 1
        else:
            seen.add(g)
    return repeated, total


def repetition_rate(tokens: Sequence[int], n: int = REPETITION_N) -> float:
    """Share of the output's n-grams that already appeared earlier in it (0.0
    for outputs shorter than n)."""
    rep, total = repetition_counts(tokens, n)
    return rep / total if total else 0.0


def first_mismatch(reference: Sequence[int], tokens: Sequence[int]) -> int | None:
    """Index of the first token where ``tokens`` differs from ``reference``
    (a length difference counts at the shorter length); None if identical."""
    for i, (a, b) in enumerate(zip(reference, tokens)):
        if a != b:
            return i
    if len(reference) != len(tokens):
        return min(len(reference), len(tokens))
    return None


def prefix_agreement(reference: Sequence[int], tokens: Sequence[int]) -> float:
    """Share of ``reference``'s tokens that ``tokens`` reproduces before the
    first difference (1.0 when identical or both empty). After a divergence
    the two continuations are conditioned on different text, so only the
    common prefix is compared."""
    if not reference:
        return 1.0 if not tokens else 0.0
    fm = first_mismatch(reference, tokens)
    return 1.0 if fm is None else min(fm, len(reference)) / len(reference)


def aggregate_speedup(
    ref: Iterable[tuple[int, float]], method: Iterable[tuple[int, float]]
) -> float:
    """Speedup of a method over the reference from per-prompt (tokens, decode
    seconds) pairs of the same prompts: ratio of aggregate tokens/s.

    Returns:
        (sum tok_m / sum t_m) / (sum tok_ref / sum t_ref); NaN if either side
        has no time or no tokens.
    """
    ref, method = list(ref), list(method)
    rt, rs = sum(t for t, _ in ref), sum(s for _, s in ref)
    mt, ms = sum(t for t, _ in method), sum(s for _, s in method)
    if rs <= 0 or ms <= 0 or rt <= 0:
        return math.nan
    return (mt / ms) / (rt / rs)


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (commas and a trailing ``.0`` removed), or
    None. ``"so 1,234.50 apples"`` -> ``"1234.5"``."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return normalize_number(found[-1])


def normalize_number(s: str) -> str | None:
    """Canonical string of a number (``"1,200.0"`` -> ``"1200"``), None if not one."""
    s = s.replace(",", "").strip().rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return None
    if math.isfinite(v) and v == int(v):
        return str(int(v))
    return repr(v)


def gsm8k_gold(answer: str) -> str | None:
    """The reference number after ``####`` in a GSM8K answer, or None."""
    if "####" not in answer:
        return None
    return normalize_number(answer.split("####")[-1].strip())


def gsm8k_correct(output: str, answer: str) -> tuple[bool, str | None, str | None]:
    """(correct, predicted number, gold number) for one GSM8K output."""
    pred, gold = extract_last_number(output), gsm8k_gold(answer)
    return (pred is not None and pred == gold), pred, gold


def summarize(records: Sequence[dict], ref: dict[tuple, dict] | None = None) -> dict:
    """Aggregate metrics over per-prompt records of ONE method.

    Args:
        records: per-prompt records (keys ``generated_tokens``,
            ``forward_passes``, ``decode_time``, ``peak_memory_gb``,
            ``rep_repeated``, ``rep_total``, optionally ``correct``, ``steps``
            and ``forward_time``).
        ref: the ``ntp`` records keyed like :func:`record_key`, for speedup.

    Returns:
        dict with ``n``, ``generated_tokens``, ``forward_passes``,
        ``decode_time_s``, ``tau``, ``forwards_per_token``, ``decode_tps``,
        ``speedup`` (None without ``ref``), ``peak_memory_gb``,
        ``repetition_rate``, ``drafted``, ``accepted``, ``host_ms_per_step``
        (decode time outside the device work, per decoding step; None when
        records lack ``forward_time``), ``idle_ms_per_step`` (the device's
        idle time waiting for the host per step: the host work on the
        critical path, known on a simulated device; None when records lack
        ``idle_time``), ``slots_per_forward`` (mean input
        slots per forward pass; None when records lack ``slots``),
        ``plain_step_share`` (the share of decoding steps that ran one token
        instead of a draft at ``auto``; None when records lack
        ``plain_steps``) and, when records carry it, ``accuracy``.
    """
    toks = sum(r["generated_tokens"] for r in records)
    fwd = sum(r["forward_passes"] for r in records)
    secs = sum(r["decode_time"] for r in records)
    rep = sum(r["rep_repeated"] for r in records)
    rep_total = sum(r["rep_total"] for r in records)
    out: dict = {
        "n": len(records),
        "generated_tokens": toks,
        "forward_passes": fwd,
        "decode_time_s": secs,
        "tau": tau(toks, fwd),
        "forwards_per_token": fwd / toks if toks else 0.0,
        "decode_tps": toks / secs if secs > 0 else 0.0,
        "speedup": None,
        "peak_memory_gb": max((r["peak_memory_gb"] for r in records), default=0.0),
        "repetition_rate": rep / rep_total if rep_total else 0.0,
        "drafted": sum(r.get("drafted", 0) for r in records),
        "accepted": sum(r.get("accepted", 0) for r in records),
        "host_ms_per_step": None,
        "idle_ms_per_step": None,
        "slots_per_forward": None,
        "plain_step_share": None,
    }
    if records and all("plain_steps" in r and r.get("steps") for r in records):
        out["plain_step_share"] = sum(r["plain_steps"] for r in records) / sum(
            r["steps"] for r in records
        )
    if records and all("slots" in r for r in records) and fwd:
        out["slots_per_forward"] = sum(r["slots"] for r in records) / fwd
    if records and all("forward_time" in r and r.get("steps") for r in records):
        host = sum(r["decode_time"] - r["forward_time"] for r in records)
        out["host_ms_per_step"] = 1000 * host / sum(r["steps"] for r in records)
    if records and all(r.get("idle_time") is not None and r.get("steps") for r in records):
        idle = sum(r["idle_time"] for r in records)
        out["idle_ms_per_step"] = 1000 * idle / sum(r["steps"] for r in records)
    if ref is not None:
        pairs = [(ref[record_key(r)], r) for r in records if record_key(r) in ref]
        if pairs:
            sp = aggregate_speedup(
                [(a["generated_tokens"], a["decode_time"]) for a, _ in pairs],
                [(b["generated_tokens"], b["decode_time"]) for _, b in pairs],
            )
            out["speedup"] = None if math.isnan(sp) else sp
    if records and all("correct" in r for r in records):
        out["accuracy"] = sum(bool(r["correct"]) for r in records) / len(records)
    return out


def record_key(r: dict) -> tuple:
    """The (question id, turn, repeat) a per-prompt record belongs to."""
    return (str(r["qid"]), int(r["turn"]), int(r["repeat"]))
