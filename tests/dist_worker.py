"""One rank of the sharded-model checks in tests/test_distributed.py.

Run by the test as N subprocesses (``MLX_HOSTFILE``/``MLX_RANK``, ring
backend). Every rank builds the same tiny models, shards a copy, and runs each
method on the unsharded and the sharded copy; it writes what it saw to
``<out>/rank<r>.json`` for the test to compare (across ranks, and against the
unsharded run). A failed check is recorded, not raised, so that the ranks stay
in step; an unexpected exception exits non-zero.

Usage: python tests/dist_worker.py OUT_DIR [tiny|smollm]
(tiny: the tiny-model method cases, then the serve worker cases)
"""

# ruff: noqa: I001  (mlx_mtp is imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx_mtp  # noqa: F401  (first: preloads OpenBLAS before mlx on Linux)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_mtp import distributed  # noqa: E402
from mlx_mtp.decoding import generate_steps
from mlx_mtp.engine import Engine
from mlx_mtp.families import check_cache_support, check_tree_support
from mlx_mtp.methods import make_method
from mlx_mtp.sampling import PositionalSampler, random_seed
from tiny_models import make_tiny_model, tiny_config
from mlx_mtp.context import Context

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
    """A backbone that sleeps for every extra slot it is given (token ids or
    input embeddings: the cost-curve timing passes): this rank then measures a
    much steeper cost curve than rank 0, and only :func:`distributed.agree`
    keeps the ranks' ``bc=auto`` trees the same."""

    def __init__(self, backbone):
        self.backbone = backbone

    def __call__(self, inputs, *args, **kwargs):
        emb = kwargs.get("input_embeddings")
        n = inputs.shape[-1] if inputs is not None else emb.shape[-2]
        if n > 1:
            time.sleep(0.002 * n)
        return self.backbone(inputs, *args, **kwargs)


def run(model, name, opts, prompt, sampler, n, slow=False, measure=False):
    """``measure``: the cost curve is measured on this rank (not the suite's
    pinned one), and ``slow`` makes this rank's measurement much steeper."""
    engine = Engine(model)
    ctx = Context(engine)
    method = make_method(name, **opts)
    check_cache_support(engine, method)
    method.prepare(ctx)
    if slow:
        engine.backbone = SlowOnThisRank(engine.backbone)
    pinned = os.environ.pop("MLX_MTP_COST_CURVE", None) if measure else None
    os.environ["MLX_MTP_REMEASURE_COST"] = "1" if measure else "0"
    toks, lens = [], []
    try:
        for step in generate_steps(ctx, method, prompt, max_tokens=n, sampler=sampler):
            toks += step.tokens
            lens.append(len(step.tokens))
    finally:
        if pinned is not None:
            os.environ["MLX_MTP_COST_CURVE"] = pinned
    curve = ctx.budget.curve if ctx.budget is not None else None  # at the last step
    return {
        "tokens": toks,
        "accept_lengths": lens,
        "forwards": step.stats.forward_passes,
        "slots": step.stats.slots,
        "curve": None if curve is None else [curve.sizes, curve.costs],
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
    from mlx_mtp.clp_format import CLPHeads, base_config, save_heads

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
                    "sharded": run(
                        sharded, name, opts, prompt, sampler, 24, slow=auto and rank, measure=auto
                    ),
                }


def smollm_cases(report):
    from mlx_mtp import load

    prompt = "List three facts about the Moon."
    m = load("smollm2-135m", "probe", dtype="float32")
    r = m.generate(prompt, max_tokens=24, temp=0.0)
    report["probe"] = {"text": r.text, "tokens": r.tokens, "forwards": r.stats.forward_passes}
    report["sharding"] = distributed.sharding(m.model)


def tiny_folder(out: Path) -> str:
    """A tiny llama saved as a model folder with SmolLM2's tokenizer (vocab
    49152), so that ``mlx-mtp serve``'s worker can load it by path."""
    import shutil

    from mlx.utils import tree_flatten

    from mlx_mtp.loading import resolve_model

    dest = out / "tiny-llama"
    dest.mkdir()
    config = tiny_config("llama", vocab_size=49152)
    model = make_tiny_model("llama", seed=0, vocab_size=49152)
    emb = model.model.embed_tokens  # flatter logits: seeded samples vary
    emb.weight = emb.weight * 0.25
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    tok = resolve_model("smollm2-135m")
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, dest / f.name)
    return str(dest)


def serve_cases(report, out):
    """The ``serve`` worker on 2 ranks: rank 0 takes the jobs (no HTTP here),
    the other rank follows; a job cancelled after its first step stops on
    both ranks; stopping rank 0's worker ends the follower."""
    from mlx_lm import load as mlx_load

    from mlx_mtp.api import MTPModel
    from mlx_mtp.loading import LoadedModel
    from mlx_mtp.server.worker import Worker

    folder = distributed.on_main(lambda: tiny_folder(out))
    worker = Worker(folder, "probe", {"bc": "10"}, dtype="float32", max_tokens=16)
    worker.start()
    report["sharding"] = distributed.sharding(worker.loaded.model)
    msgs = [{"role": "user", "content": "Count to ten."}]
    if not distributed.is_main():
        worker.wait()
        report["counts"] = worker.counts
    else:
        serve_jobs(report, worker, folder, msgs)
    # the unsharded reference (mlx_lm.load: no sharding), same requests, on
    # every rank (the seed is agreed on, a collective)
    model, tok, cfg = mlx_load(folder, return_config=True)
    loaded = LoadedModel(model, tok, Path(folder), cfg, folder, "float32")
    ref = {}
    for name, opts in (("probe", {"bc": "10"}), ("pld", {})):
        r = MTPModel(loaded, make_method(name, **opts)).generate(msgs, max_tokens=16)
        ref[name] = r.text
    r = MTPModel(loaded, make_method("probe", bc="10")).generate(
        msgs, max_tokens=16, temp=0.9, seed=7
    )
    ref["seeded"] = r.text
    report["ref"] = ref


def serve_jobs(report, worker, folder, msgs):
    """Rank 0: submit jobs to the worker and record what the clients got."""
    import threading

    from mlx_mtp.server import events as E
    from mlx_mtp.server.protocol import GenRequest
    from mlx_mtp.server.worker import Job

    def submit(req, cancel_after_start=False):
        events, done = [], threading.Event()

        def emit(event):
            # the worker's typed events (mlx_mtp.server.events) as plain tuples
            if isinstance(event, E.Taken):
                return
            if isinstance(event, E.Started):
                ev = ("started",)
            elif isinstance(event, E.Delta):
                ev = ("delta", event.text)
            elif isinstance(event, E.Done):
                ev = ("done", event.finish_reason)
            elif isinstance(event, E.Failed):
                ev = ("error", str(event.error))
            else:
                ev = ("cancelled",)
            events.append(ev)
            if ev[0] == "started" and cancel_after_start:
                job.cancel.set()
            if ev[0] in ("done", "error", "cancelled"):
                done.set()

        job = Job(req, emit=emit)
        worker.submit(job)
        done.wait(600)
        text = "".join(ev[1] for ev in events if ev[0] == "delta")
        return text, events[-1][0], events[-1][1] if len(events[-1]) > 1 else None

    report["jobs"] = {
        "probe": submit(GenRequest("chat", folder, msgs)),
        "pld": submit(GenRequest("chat", folder, msgs, method="pld")),
        "cancelled": submit(GenRequest("chat", folder, msgs, max_tokens=64), True),
        "seeded": submit(GenRequest("chat", folder, msgs, temperature=0.9, seed=7)),
    }
    worker.stop()
    report["counts"] = worker.counts


def main() -> None:
    out = Path(sys.argv[1])
    which = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    report: dict = {"rank": distributed.rank(), "size": distributed.size()}
    if which in ("tiny", "serve"):
        if which == "tiny":
            tiny_cases(report, out)
        serve_cases(report, out)
    else:
        smollm_cases(report)
    distributed.barrier()
    (out / f"rank{distributed.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
