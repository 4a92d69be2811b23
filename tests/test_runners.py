"""The runner of a generation, chosen in one place (:mod:`mlx_mtp.runners`) and
reported: ``stats.runner`` and its reason, the stats line, ``to_dict``, the
server's ``mtp`` block, the bench's records; ``--runner`` on the commands."""

from __future__ import annotations

import pytest

from mlx_mtp.budget import CostCurve
from mlx_mtp.decoding import GenerationStats
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.runners import ENV, choose_runner

PROMPT = list(range(100, 140)) * 2  # repeats: prompt lookup finds drafts
N = 16


def _run(smollm, method="pld", runner="auto", **kw):
    opts = kw.pop("opts", {})
    m = smollm.bind(method, runner=runner, max_kv_size=kw.pop("max_kv_size", None), **opts)
    return m.generate(PROMPT, max_tokens=N, chat_template=False, **kw)


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def test_each_runner_is_reported_and_exact(smollm, greedy_reference):
    """ntp runs plain steps whatever is asked; pld runs the runner asked for
    (auto: synchronous on this CPU), each with its reason, all exact."""
    want = greedy_reference(PROMPT, N)
    for method, asked, ran in [
        ("ntp", "auto", "plain"),
        ("ntp", "pipelined", "plain"),
        ("pld", "auto", "synchronous"),
        ("pld", "pipelined", "pipelined"),
        ("pld", "synchronous", "synchronous"),
    ]:
        r = _run(smollm, method, asked)
        st = r.stats
        assert r.tokens == want, (method, asked)
        assert st.runner == ran and st.runner_reason, (method, asked)
        assert f"] {ran}: " in st.summary().splitlines()[0]
        assert st.to_dict()["runner"] == ran
    assert "auto" in _run(smollm, "pld").stats.runner_reason


@pytest.mark.parametrize(
    "setting,says",
    [
        ({"temp": 0.7}, "greedily only"),
        ({"logprobs": 1}, "logprobs"),
        ({"max_kv_size": 64}, "cache is not plain"),
        ({"method": "lookahead"}, "no device drafter"),
        ({"method": "probe", "opts": {"shape": "chain"}}, "no device drafter"),
    ],
)
def test_pipelined_where_it_cannot_run_says_why(smollm, setting, says):
    """Never a silent fallback: one line that names the reason."""
    setting = dict(setting)
    method = setting.pop("method", "pld")
    with pytest.raises(InvalidArgumentError, match=says) as e:
        _run(smollm, method, "pipelined", **setting)
    assert "\n" not in str(e.value) and "pipelined" in str(e.value)


def test_an_unknown_runner_is_refused_at_bind(smollm):
    with pytest.raises(InvalidArgumentError, match="auto, pipelined, synchronous"):
        smollm.bind("pld", runner="fast")


def test_the_environment_variable_is_a_deprecated_fallback(smollm, monkeypatch):
    """``MLX_MTP_PIPELINE`` still picks the runner where ``auto`` is asked,
    with a deprecation warning; an explicit runner wins over it."""
    monkeypatch.setenv(ENV, "1")
    with pytest.warns(DeprecationWarning, match="--runner"):
        st = _run(smollm, "pld").stats
    assert st.runner == "pipelined" and ENV in st.runner_reason
    assert _run(smollm, "pld", "synchronous").stats.runner == "synchronous"
    monkeypatch.setenv(ENV, "1")
    with pytest.warns(DeprecationWarning):  # where pipelined cannot run: the planner, as before
        assert _run(smollm, "pld", temp=0.5, seed=1).stats.runner == "synchronous"


def test_choose_runner_builds_the_runner_it_names(smollm):
    from mlx_mtp.context import Context
    from mlx_mtp.engine import Engine
    from mlx_mtp.methods import make_method
    from mlx_mtp.pipeline import Pipeline
    from mlx_mtp.planner import Planner

    ctx = Context(Engine(smollm.model))
    m = make_method("pld", max_draft=4)  # a fixed width: no cost curves needed
    m.prepare(ctx)
    for asked, cls in [("pipelined", Pipeline), ("synchronous", Planner), ("auto", Planner)]:
        choice = choose_runner(ctx, m, None, None, runner=asked)
        assert isinstance(choice.runner, cls), asked
        assert choice.name == ("synchronous" if asked == "auto" else asked)
    choice = choose_runner(ctx, make_method("ntp"), None, None, runner="pipelined")
    assert choice.name == "plain" and choice.runner is None


def test_pipelined_plain_steps_say_why(smollm):
    """A pipelined run whose policy judged no draft worth its cost says so,
    not that the method had nothing to draft."""
    m = smollm.bind("pld", runner="pipelined")
    m.ctx.curves = CostCurve.linear(1.0)  # every slot a whole forward: nothing pays
    st = m.generate(PROMPT, max_tokens=N, chat_template=False).stats
    assert st.plain_steps > 0 and st.declined_steps > 0
    line = st.summary().splitlines()[1]
    assert "policy judged no draft worth its cost" in line


@pytest.mark.parametrize(
    "fields,says,not_says",
    [
        (
            {"plain_steps": 5, "steps": 9, "declined_steps": 5},
            "5 because the policy judged no draft worth its cost",
            "nothing to draft",
        ),
        (
            {"plain_steps": 5, "steps": 9, "declined_steps": 3},
            "3 because the policy judged no draft worth its cost on this device (an 8-slot "
            "pass costs 0.00 1-slot passes here); 2 because the method had nothing to draft",
            "auto kept",
        ),
        ({"plain_steps": 5, "steps": 9}, "5 because the method had nothing to draft", "policy"),
    ],
)
def test_pipelined_stats_line_cases(fields, says, not_says):
    line = GenerationStats(method="m", runner="pipelined", **fields).summary()
    assert line.startswith("[m] pipelined: ")
    assert says in line and not_says not in line


def test_batched_rows_report_batched(smollm):
    results = smollm.batch_generate([[1, 2, 3], [4, 5]], max_tokens=4, chat_template=False)
    assert [r.stats.runner for r in results] == ["batched", "batched"]
    from types import SimpleNamespace

    from mlx_mtp.server.replies import mtp_stats

    assert mtp_stats(results[0].stats, 0, SimpleNamespace(queue_wait=0.0))["runner"] == "batched"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_commands_take_runner_and_pipeline_parallel(command):
    from typer.testing import CliRunner

    from mlx_mtp.cli import app

    out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    assert "--runner" in out and "--pipeline-parallel" in out
    assert "--pipeline " not in out  # the old name still parses, unlisted


def test_cli_refuses_an_unknown_runner_before_loading():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "mlx_mtp.cli", "generate", "-p", "hi", "--runner", "fast"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: runner must be one of auto, pipelined, synchronous; got 'fast'."
    ]
