"""One rank of the sharded-model checks in tests/test_distributed.py.

Run by the test as N subprocesses (``MLX_HOSTFILE``/``MLX_RANK``, ring
backend). Every rank builds the same tiny models, shards a copy, and runs each
method on the unsharded and the sharded copy; it writes what it saw to
``<out>/rank<r>.json`` for the test to compare (across ranks, and against the
unsharded run). A failed check is recorded, not raised, so that the ranks stay
in step; an unexpected exception exits non-zero.

Usage: python tests/dist_worker.py OUT_DIR [tiny|smollm]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_mtp import distributed
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine, check_cache_support, check_tree_support
from mlx_mtp.methods import make_method
from mlx_mtp.sampling import PositionalSampler, random_seed
from mlx_mtp.testing import make_tiny_model

#: (name, method, options) run on every model
METHODS = [
    ("ntp", "ntp", {}),
    ("pld", "pld", {}),
    ("probe", "probe", {"bc": 10}),
    ("probe-auto", "probe", {"bc": "auto"}),
    ("hybrid", "hybrid", {"bc": 12}),
    ("hybrid-auto", "hybrid", {"bc": "auto"}),
    ("lookahead", "lookahead", {}),
]


class SlowOnThisRank:
    """A backbone that sleeps for every extra token it is given as ids (the
    ``slot_cost`` timing passes): this rank then measures a much larger slot
    cost than rank 0, and only :func:`distributed.agree` keeps the ranks'
    ``bc=auto`` trees the same."""

    def __init__(self, backbone):
        self.backbone = backbone

    def __call__(self, inputs, *args, **kwargs):
        if inputs is not None and inputs.shape[-1] > 1:
            time.sleep(0.002 * inputs.shape[-1])
        return self.backbone(inputs, *args, **kwargs)


def run(model, name, opts, prompt, sampler, n, slow=False):
    engine = Engine(model)
    method = make_method(name, **opts)
    check_cache_support(engine, method)
    method.prepare(engine)
    if slow:
        engine.backbone = SlowOnThisRank(engine.backbone)
    toks, lens = [], []
    for step in generate_steps(engine, method, prompt, max_tokens=n, sampler=sampler):
        toks += step.tokens
        lens.append(len(step.tokens))
    return {
        "tokens": toks,
        "accept_lengths": lens,
        "forwards": step.stats.forward_passes,
        "slots": step.stats.slots,
        "slot_costs": sorted(engine._slot_costs.items()),
    }


def logits_diff(ref, sharded, prompt):
    """Largest |difference| of the logits of a causal pass over the prompt and
    of a 5-slot tree pass after it (the tree mask, per-slot positions)."""
    diffs = []
    x = mx.array(prompt)[None]
    diffs.append(float(mx.max(mx.abs(ref(x) - sharded(x))).item()))
    parents = np.array([-1, 0, 0, 1, 1])
    outs = []
    for m in (ref, sharded):
        check_tree_support(m, "probe")
        e = Engine(m)
        e.sync(prompt)
        emb = e.embed_tokens([3, 5, 7, 9, 11])
        outs.append(e.forward_tree(emb, parents, [3, 5, 7, 9, 11])[0])
    diffs.append(float(mx.max(mx.abs(outs[0] - outs[1])).item()))
    return max(diffs)


def tiny_heads(model, folder):
    """CLP heads (2 ahead) for the unsharded ``model``, random but the same on
    every rank (as tests/test_clp.py makes them)."""
    from mlx_mtp.clp_heads import CLPHeads, base_config, save_heads

    cfg = base_config(model, "tiny", 2, "resblock", bottleneck=16, gate_hidden=None)
    mx.random.seed(5)
    heads = CLPHeads(cfg)
    for h in heads.heads:
        h.w2.weight = mx.random.normal(h.w2.weight.shape) * 0.5
    mx.eval(heads.parameters())
    return str(save_heads(heads, folder))


def tiny_cases(report, out):
    rank = distributed.rank()
    # agree: rank 0's value everywhere, bit for bit
    report["agree"] = distributed.agree({"rank": rank, "x": 0.1 + rank})
    report["agree_flag"] = distributed.agree_flag(rank == 0)
    seed = distributed.agree(random_seed())
    report["seed"] = seed
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, 250, 12)] * 2
    for family, pipeline in (("llama", False), ("qwen2", True)):
        ref = make_tiny_model(family, seed=0)
        sharded = make_tiny_model(family, seed=0)
        how = distributed.shard_model(sharded, pipeline=pipeline)
        mx.eval(sharded.parameters())
        fam = report.setdefault(family, {"sharding": how})
        fam["logits_diff"] = logits_diff(ref, sharded, prompt)
        heads = tiny_heads(ref, out / f"heads-{family}-rank{rank}")
        clp = [
            ("clp", "clp", {"heads": heads, "predictor": "all"}),
            ("clp-paper", "clp", {"heads": heads, "predictor": "all", "mode": "paper"}),
        ]
        for label, name, opts in METHODS + clp:
            for temp in (0.0, 0.8):
                key = f"{label}@{temp}"
                sampler = PositionalSampler(temp, top_p=0.9, seed=seed) if temp else None
                auto = opts.get("bc") == "auto"
                fam[key] = {
                    "unsharded": run(ref, name, opts, prompt, sampler, 24),
                    "sharded": run(sharded, name, opts, prompt, sampler, 24, slow=auto and rank),
                }


def smollm_cases(report):
    from mlx_mtp import load

    prompt = "List three facts about the Moon."
    m = load("smollm2-135m", "probe", dtype="float32")
    r = m.generate(prompt, max_tokens=24, temp=0.0)
    report["probe"] = {"text": r.text, "tokens": r.tokens, "forwards": r.stats.forward_passes}
    report["sharding"] = distributed.sharding(m.model)


def main() -> None:
    out = Path(sys.argv[1])
    which = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    report: dict = {"rank": distributed.rank(), "size": distributed.size()}
    if which == "tiny":
        tiny_cases(report, out)
    else:
        smollm_cases(report)
    distributed.barrier()
    (out / f"rank{distributed.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
