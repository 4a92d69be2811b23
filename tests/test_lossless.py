"""Every lossless method reproduces plain greedy decoding token for token on
the real models (float32) and really drafts (accepted draft tokens, fewer
forward passes than tokens: no silent fallback to plain decoding,
docs/design.md failure classes 7 and 10).

One set-up per model, built once for the session (``smollm_case``,
``qwen_case``, ``gemma_case`` in conftest.py): a few prompts, one engine
whose prompt cache each run reuses, and one memoised greedy reference
computed on an engine of its own. One method instance decodes all of a
model's prompts, so what it learns on one (recycle's table, the planner's
estimates) is carried to the next.

Each setting runs on the synchronous steps (the planner, the default on a
CPU) and, where the method has a device form, on the pipelined steps too
(the default on a GPU): one test, parametrized by runner; the stats name
the runner that ran.

The settings cover each method's mechanisms once: fixed and ``auto`` block
complexities, one and two mask slots, learned mask vectors, recycle's table
alone and as a source of hybrid, CLP's shipped heads (SmolLM2) and freshly
initialised ones (verification, not head quality). Gemma 3 runs every token
past its 512-token sliding window (failure classes 1 and 2). ``-m slow`` runs
every setting on 30 prompts x 64 tokens (tests/test_probe.py, test_qwen.py,
test_gemma.py, ...). Sampling at temperature > 0 is proved once for the
verification every method goes through (tests/test_speculative.py).
"""

from __future__ import annotations

import pytest
from conftest import decode, untrained_clp_heads

from mlx_mtp.context import Context
from mlx_mtp.methods import make_method

#: (model, method, options): every lossless method on each real model. SmolLM2
#: runs each mechanism once (fixed and auto budgets, one and two mask slots,
#: learned masks, recycle's table alone and inside hybrid). Qwen2.5-Coder
#: (qwen2: q/k/v biases, an untied LM head, a 151,936-token vocabulary) runs
#: each method whose drafts depend on the model's outputs, at small fixed
#: budgets (a 30-slot pass of it costs seconds on one CPU core); Gemma 3
#: (sliding windows) the tree methods at their defaults. Lookahead's drafts do
#: not read the model's outputs beyond the tree pass: SmolLM2, Gemma 3 and tiny
#: qwen2 models (tests/test_lookahead.py) cover it.
SETTINGS = [
    ("smollm", "pld", {}),
    ("smollm", "probe", {"bc": 10}),
    ("smollm", "probe", {"bc": 30, "masks": 2, "mask_init": "learned"}),
    ("smollm", "probe", {}),  # auto: up to 64 slots on the suite's memory-bound curve
    ("smollm", "hybrid", {}),
    ("smollm", "hybrid", {"bc": 30, "masks": 2, "mask_init": "learned", "recycle": 1}),
    ("smollm", "recycle", {}),
    ("smollm", "lookahead", {}),
    ("smollm", "clp", {}),  # the shipped heads, found by fingerprint
    ("qwen", "pld", {}),
    ("qwen", "probe", {"bc": 10}),
    ("qwen", "hybrid", {"bc": 10, "recycle": 1}),
    ("qwen", "clp", {"heads": "untrained"}),
    ("gemma", "pld", {}),
    ("gemma", "probe", {}),
    ("gemma", "hybrid", {}),
    ("gemma", "lookahead", {}),
]

#: the settings run again on the pipelined steps (mlx_mtp/pipeline.py: the
#: default runner on a GPU, forced here on the CPU), each method's device
#: form: chains (pld; clp's heads, run inside each pass), trees whose accepted
#: path moves cache rows (recycle's table), ESP's mask slots (probe) and all
#: of them in one tree (hybrid), at
#: auto and at fixed budgets, on SmolLM2 and on Qwen2.5-Coder (qwen2). Gemma
#: 3's rotating caches and the methods without a device form run only the
#: synchronous steps (tests/test_runners.py checks that they are refused).
PIPELINED = [
    ("smollm", "pld", {}),
    ("smollm", "pld", {"max_draft": 10}),
    ("smollm", "probe", {}),
    ("smollm", "probe", {"bc": 30, "masks": 2, "mask_init": "learned"}),
    ("smollm", "hybrid", {}),
    ("smollm", "hybrid", {"bc": 30, "masks": 2, "mask_init": "learned", "recycle": 1}),
    ("smollm", "recycle", {}),
    ("smollm", "recycle", {"bc": 30}),
    ("smollm", "clp", {}),
    ("qwen", "pld", {}),
    ("qwen", "probe", {"bc": 10}),
    ("qwen", "clp", {}),  # the shipped heads
]
RUNS = [(*s, "synchronous") for s in SETTINGS] + [(*s, "pipelined") for s in PIPELINED]


def _id(run) -> str:
    model, name, opts, runner = run
    return "-".join([model, name, *(f"{k}{v}" for k, v in opts.items()), runner])


@pytest.mark.parametrize("model,name,opts,runner", RUNS, ids=[_id(r) for r in RUNS])
def test_equals_greedy_and_drafts(request, tmp_path, model, name, opts, runner):
    case = request.getfixturevalue(f"{model}_case")
    untrained = opts.get("heads") == "untrained"
    if untrained:
        opts = {**opts, "heads": untrained_clp_heads(case.loaded, tmp_path / "heads")}
    method = make_method(name, **opts)
    drafted = accepted = passes = tokens = 0
    for i, ((prompt, n), engine) in enumerate(zip(case.prompts, case.engines)):
        ctx = Context(engine, case.loaded)
        method.prepare(ctx)
        out, stats = decode(ctx, method, prompt, n, eos_ids=set(), runner=runner)
        assert out == case.greedy(prompt, n), f"{method.describe()}, {runner}, prompt {i}"
        assert stats.runner == runner
        assert engine.cached == prompt + out[:-1]  # the loop's cache invariant
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        passes, tokens = passes + stats.forward_passes, tokens + stats.generated_tokens
    assert drafted > 0, method.describe()
    if not untrained:  # heads that repeat the backbone's token are rarely right
        assert accepted > 0 and passes < tokens, (method.describe(), accepted, passes, tokens)
