"""Wall time of pipelined one-token steps, of the step that stops the
pipeline (finishes the queued pass, queues none: the step before a draft
step) and of the step that starts it again (the step after a draft step),
on this machine's MLX device.

    OPENBLAS_NUM_THREADS=1 python examples/pipeline_stop.py --model smollm2-135m

Prints, per round, the median of the steady steps and the stop and restart
steps' times in ms, then the medians over rounds, the first step after the
prefill (plain decoding's own start, a restart too) and the pair's cost in
steady steps. The planner measures a draft step's host work with both
around it (:mod:`mlx_mtp.steptimes`): on a CPU the stop finds its pass
mostly done and the restart waits for two, so the pair costs about two
steady steps and the restart alone would overstate a draft step's cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

# isort: off
import mlx_mtp  # noqa: F401  (first: it loads OpenBLAS before mlx on Linux)

# isort: on
import mlx.core as mx

from mlx_mtp.engine import Engine
from mlx_mtp.loading import load_model
from mlx_mtp.plain import PlainSteps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steady", type=int, default=8, help="pipelined steps per round")
    args = ap.parse_args()

    loaded = load_model(args.model, dtype=args.dtype)
    engine = Engine(loaded.model)
    prompt = loaded.tokenizer.encode("Write a long story about a cat and a dog who become friends.")
    logits, _ = engine.forward_chain(list(prompt), wait=True)
    root = int(mx.argmax(logits[-1]).item())
    steps = PlainSteps(None)

    def step(queue_next: bool) -> float:
        nonlocal root
        t0 = time.perf_counter()
        root = steps.step(engine, root, queue_next)[0]
        return 1000 * (time.perf_counter() - t0)

    first = step(True)  # the pipeline's first start: plain decoding's first step
    rows = []
    for r in range(args.rounds):
        steady = statistics.median(step(True) for _ in range(args.steady))
        stop, restart = step(False), step(True)
        rows.append((steady, stop, restart))
        print(f"round {r}: steady {steady:.1f} ms  stop {stop:.1f} ms  restart {restart:.1f} ms")
    steady, stop, restart = (statistics.median(c) for c in zip(*rows))
    print(
        f"median ({args.model}, {args.dtype}, {mx.default_device()}): first step {first:.1f} ms, "
        f"steady {steady:.1f} ms, stop {stop:.1f} ms, restart {restart:.1f} ms; stop + restart = "
        f"{(stop + restart) / steady:.2f} steady steps, restart alone "
        f"{restart / steady - 1:+.2f} steps"
    )


if __name__ == "__main__":
    main()
