"""Drafting inside a batch against plain batched decoding, on this machine or
on a simulated device.

Answers the first ``--prompts`` Spec-Bench prompts (round-robin over
``--tasks``, prompts under ``--below`` tokens) with ``--max-tokens`` new
tokens, greedy, through :class:`~mlx_mtp.batching.DraftBatch` (at most
``--max-batch`` rows per forward pass, prompts joining as others leave),
once per method and round: ``plain`` (the same batch drafting nothing) and
each drafting method (``pld``, ``recycle``, ``probe``, ``hybrid``, ``clp``;
``draft`` with ``--draft-model``). Prints each method's decoding tokens per
second (prefills left out: the clock stops while a prompt is prefilled), its
ratio to ``plain`` in the same round, tau (tokens per row and forward pass),
the mean slots per pass and the share of passes that drafted, and how many
answers equal the solo greedy answer token for token.

``--device 'ms_per_token=12,curve=1:1,16:1.05,64:1.3'`` runs on the virtual
clock of a simulated device (:mod:`mlx_mtp.bench.simulate`): every forward
pass of ``n`` slots (rows x width) takes ``ms_per_token * curve(n)``, the
mask candidates' LM head and the CLP heads their weight bytes' share of a
one-token pass, a draft model's pass its weight share; host work takes its
real time. The batch measures those times and drafts where they pay.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python examples/batch_simulated.py \\
        --prompts 8 --max-tokens 64 --max-batch 4 \\
        [--device 'ms_per_token=12,curve=1:1,16:1.05,64:1.3'] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform

from batch_agreement import spec_prompts

from mlx_mtp.api import MTPModel, native_layer
from mlx_mtp.batching import DraftBatch
from mlx_mtp.bench.simulate import simulating
from mlx_mtp.clp_format import heads_for
from mlx_mtp.data import TASKS
from mlx_mtp.loading import draft_for, load_model
from mlx_mtp.methods import make_method


def run(batch: DraftBatch, prompts: list[list[int]], limit: int, max_batch: int) -> dict:
    """Decode every prompt through ``batch``; its answers and figures, timed
    on the batch's clock with the prefills left out."""
    clock = batch.clock
    pause = getattr(clock, "pause", None)
    out, uid_of, waiting = {}, {}, list(range(len(prompts)))
    seconds = passes = slots = drafting = 0
    while waiting or len(batch):
        while waiting and len(batch) < max_batch:
            i = waiting.pop(0)
            if pause:
                pause()
            uid, got = batch.add(prompts[i], limit)
            if pause:
                clock.resume()
            uid_of[uid], out[i] = i, list(got.tokens)
        t0 = clock.now()
        width = len(batch.rows)
        step = batch.step()
        seconds += clock.now() - t0
        passes += 1
        for got in step:
            out[uid_of[got.uid]].extend(got.tokens)
        slots += batch.last_slots
        drafting += batch.last_slots > width
    rows = list(batch.finished.values())
    tokens = sum(len(r.generated) - 1 for r in rows)  # the first tokens come from prefill
    return {
        "answers": [out[i] for i in range(len(prompts))],
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "tau": tokens / max(sum(r.passes for r in rows), 1),
        "slots_per_pass": slots / max(passes, 1),
        "drafting_passes": drafting / max(passes, 1),
    }


def main() -> None:
    """Run the comparison and print (and optionally save) the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--below", type=int, default=700, help="prompts under this many tokens")
    ap.add_argument("--tasks", default=",".join(TASKS), help="Spec-Bench tasks to draw from")
    ap.add_argument("--methods", default="pld,recycle,probe,hybrid,clp",
                    help="drafting methods, comma-separated")  # fmt: skip
    ap.add_argument("--draft-model", default=None, help="the draft model of method draft")
    ap.add_argument("--rounds", type=int, default=1, help="runs of every method, alternating")
    ap.add_argument("--device", default=None,
                    help="a simulated device (MLX_MTP_SIMULATE_DEVICE form)")  # fmt: skip
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    lm = load_model(args.model, args.dtype)
    prompts = spec_prompts(lm.tokenizer, args.prompts, args.below, tuple(args.tasks.split(",")))
    methods = args.methods.split(",")
    ntp = MTPModel(lm, make_method("ntp"))
    solo = [ntp.generate(p, max_tokens=args.max_tokens).tokens for p in prompts]
    heads = heads_for(lm.model, None, lm.name)[0] if "clp" in methods else None
    draft = draft_for(lm, args.draft_model).model if "draft" in methods else None
    native = native_layer(lm) if "mtp" in methods else None

    def batch(method: str) -> DraftBatch:
        if method == "plain":
            return DraftBatch(lm.model, ntp.eos_ids, max_draft=0)
        return DraftBatch.for_method(
            lm.model, ntp.eos_ids, method, draft_model=draft, heads=heads, native=native,
            max_draft=args.max_draft,
        )  # fmt: skip

    results: dict[str, list[dict]] = {m: [] for m in ["plain", *methods]}
    with simulating(args.device or ""):
        run(batch("plain"), prompts[:2], 8, args.max_batch)  # warm-up
        for _ in range(args.rounds):
            for m in ["plain", *methods]:
                results[m].append(run(batch(m), prompts, args.max_tokens, args.max_batch))
    device = args.device or f"this machine ({platform.machine()}, MLX CPU)"
    print(f"{args.model} {args.dtype}, {len(prompts)} prompts x {args.max_tokens} tokens, "
          f"batch {args.max_batch}, device: {device}")  # fmt: skip
    print(f"{'method':8} {'tok/s':>8} {'vs plain':>9} {'tau':>5} {'slots/pass':>10} "
          f"{'drafting':>8} {'= solo':>7}")  # fmt: skip
    summary = {}
    for m, runs in results.items():
        ratios = [r["tok_s"] / p["tok_s"] for r, p in zip(runs, results["plain"])]
        equal = sum(a == s for r in runs for a, s in zip(r["answers"], solo))
        row = {
            "tok_s": [round(r["tok_s"], 2) for r in runs],
            "vs_plain": [round(x, 3) for x in ratios],
            "tau": round(sum(r["tau"] for r in runs) / len(runs), 3),
            "slots_per_pass": round(sum(r["slots_per_pass"] for r in runs) / len(runs), 2),
            "drafting_passes": round(sum(r["drafting_passes"] for r in runs) / len(runs), 3),
            "equal_solo": f"{equal}/{len(runs) * len(prompts)}",
        }
        summary[m] = row
        print(f"{m:8} {sum(row['tok_s']) / len(runs):8.2f} "
              f"{sum(ratios) / len(ratios):8.3f}x {row['tau']:5.2f} {row['slots_per_pass']:10.2f} "
              f"{row['drafting_passes']:8.0%} {row['equal_solo']:>7}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": device, "methods": summary}, f, indent=1)


if __name__ == "__main__":
    main()
