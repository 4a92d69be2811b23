"""What each part of ``hybrid``'s pipelined tree delivered against what its
values promised, on the simulated device.

``hybrid``'s pipelined steps draft one tree of three parts under the root:
prompt lookup, the table of the model's own predictions (token recycling)
and ESP's mask slots (:class:`mlx_mtp.pipeline.CompositeDrafter`). Its
width policy keeps the best-valued nodes of all three. For each setting
given (default ``hybrid`` and ``hybrid:bc=30``), one model decodes the
bench's warm-up and the first Spec-Bench mt_bench, translation and
summarization prompts x 64 tokens, the KV cache dropped before each (as
``mlx-mtp bench --limit 1`` does, not interleaved).

    OPENBLAS_NUM_THREADS=1 MLX_MTP_SIMULATE_DEVICE="ms_per_token=12,curve=1:1,16:1.05,64:1.3" \\
        python examples/hybrid_parts.py hybrid hybrid:bc=30

Prints per prompt the virtual decode tok/s, tau, and for each part the
tokens its nodes had accepted over the sum of their raw values (before the
composite's per-part calibration scales them), over the steps it drafted in.
"""

from __future__ import annotations

import sys
from collections import defaultdict

from mlx_mtp.acceptance import Calibration
from mlx_mtp.api import MTPModel
from mlx_mtp.bench.simulate import install
from mlx_mtp.data import load_questions
from mlx_mtp.loading import load_model
from mlx_mtp.methods import make_method
from mlx_mtp.pipeline import CompositeDrafter

PARTS = ("lookup", "table", "masks")


def main() -> None:
    if install() is None:
        raise SystemExit("set MLX_MTP_SIMULATE_DEVICE (see the module doc)")
    composites: list[CompositeDrafter] = []
    sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])  # predicted, accepted

    init, record = CompositeDrafter.__init__, Calibration.record

    def composite_init(self, parts):
        init(self, parts)
        composites.append(self)

    def counted(self, predicted, accepted):
        s = sums[id(self)]
        s[0] += predicted
        s[1] += accepted
        return record(self, predicted, accepted)

    CompositeDrafter.__init__ = composite_init
    Calibration.record = counted

    loaded = load_model("smollm2-135m", dtype="float32")
    first: dict[str, dict] = {}
    for q in load_questions():
        first.setdefault(q["task"], q)
    for spec in sys.argv[1:] or ["hybrid", "hybrid:bc=30"]:
        name, *opts = spec.split(":")
        m = MTPModel(loaded, make_method(name, **dict(o.split("=") for o in opts)))
        m.engine.reset()
        m.generate([{"role": "user", "content": "Say hello in three words."}], max_tokens=8)
        for task in ("mt_bench", "translation", "summarization"):
            composites.clear()
            sums.clear()
            m.engine.reset()
            r = m.generate([{"role": "user", "content": first[task]["turns"][0]}], max_tokens=64)
            cols = []
            for comp in composites:
                for part, cal in zip(PARTS, comp.calibrations):
                    pred, acc = sums[id(cal)]
                    cols.append(f"{part} {acc:.0f}/{pred:.1f}")
            print(
                f"{spec} {task}: {r.stats.decode_tps:.1f} tok/s, tau {r.stats.tau:.2f}, "
                f"accepted/valued per part: {', '.join(cols)}"
            )


if __name__ == "__main__":
    main()
