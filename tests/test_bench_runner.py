"""The bench runner: results.json schema, report, plots, resume after
interruption, settings guard, second turns, GSM8K mode and the mlx-lm rows
(plumbing: a tiny model with SmolLM2's tokenizer), and what depends on the
real model (its EOS, its draft model, its steps' timing interleaved, its pass
time against a simulated device: SmolLM2)."""

from __future__ import annotations

import json

import pytest

from mlx_mtp.bench import runner
from mlx_mtp.bench.config import BenchConfig, parse_methods
from mlx_mtp.bench.report import SCHEMA
from mlx_mtp.errors import InvalidArgumentError

METHOD_KEYS = {
    "label",
    "name",
    "options",
    "describe",
    "lossless",
    "block_complexity",
    "runner",
    "overall",
    "tasks",
    "exactness",
}
SUMMARY_KEYS = {
    "n",
    "generated_tokens",
    "forward_passes",
    "decode_time_s",
    "tau",
    "forwards_per_token",
    "decode_tps",
    "speedup",
    "peak_memory_gb",
    "repetition_rate",
    "drafted",
    "accepted",
}


@pytest.fixture(scope="module")
def tiny(smollm):
    """A tiny random llama with SmolLM2's tokenizer and chat template: the
    bench's plumbing (records, resume, reports, turns, interleaving) on a
    model whose passes take a millisecond. Tests whose figures depend on a
    real model (EOS, a pass slower than a simulated device, a draft model,
    drafting steps to time) use ``smollm``."""
    from tiny_models import make_tiny_model, tiny_config

    from mlx_mtp.loading import LoadedModel

    config = tiny_config("llama", vocab_size=49152)
    model = make_tiny_model("llama", vocab_size=49152)
    return LoadedModel(model, smollm.tokenizer, smollm.path, config, "tiny", "float32")


def _cfg(tmp_path, **kw) -> BenchConfig:
    base = dict(
        model="smollm2-135m",
        methods=parse_methods("ntp,pld"),
        categories=["qa", "translation"],
        limit=1,
        max_tokens=8,
        dtype="float32",
        out=str(tmp_path / "out"),
    )
    base.update(kw)
    return BenchConfig(**base)


def test_results_schema_report_and_plots(tiny, tmp_path):
    cfg = _cfg(tmp_path)
    res = runner.run_bench(cfg, tiny, progress=False)
    out = tmp_path / "out"
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(res))
    assert res["schema"] == SCHEMA
    assert {
        "settings",
        "environment",
        "reference",
        "tasks",
        "definitions",
        "methods",
        "prompts",
    } <= set(res)
    assert res["tasks"] == ["qa", "translation"]
    assert [m["label"] for m in res["methods"]] == ["ntp", "pld"]
    for m in res["methods"]:
        assert set(m) == METHOD_KEYS
        assert SUMMARY_KEYS <= set(m["overall"])
        assert set(m["tasks"]) == {"qa", "translation"}
        assert m["overall"]["n"] == 2
    ntp, pld = res["methods"]
    assert ntp["overall"]["tau"] == 1.0 and ntp["overall"]["speedup"] == pytest.approx(1.0)
    assert ntp["exactness"] is None
    assert pld["exactness"]["checked"] == 2
    assert pld["exactness"]["exact"] == 2 and pld["exactness"]["mismatches"] == []
    assert len(res["prompts"]) == 4
    assert all(p["exact"] is not False for p in res["prompts"])
    report = (out / "report.md").read_text()
    assert "| Method | BC | qa | translation | Overall | Mean accepted tokens (tau) |" in report
    assert "| ntp | 1 | 1.00x | 1.00x | 1.00x | 1.00 |" in report
    for png in ("speedup_per_task.png", "tau_vs_bc.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_without_the_plotting_extra_runs_and_says_how_to_get_plots(
    tmp_path, capsys, monkeypatch
):
    """matplotlib is the optional ``bench`` extra: without it ``mlx-mtp bench``
    still writes results.json and report.md, and one line says how to get
    the plots."""
    import sys

    from conftest import run_cli

    from mlx_mtp.bench.plots import PLOT_FILES

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    out = tmp_path / "out"
    argv = ["bench", "--methods", "ntp", "--categories", "qa", "--limit", "1", "-n", "2"]
    code, err = run_cli([*argv, "--out", str(out)], capsys)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if "matplotlib" in ln]
    assert len(lines) == 1 and "pip install 'mlx-mtp[bench]'" in lines[0], err
    assert (out / "results.json").exists() and (out / "report.md").exists()
    assert not [p for p in PLOT_FILES if (out / p).exists()]


def test_resume_runs_only_missing_entries(tiny, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    runner.run_bench(cfg, tiny, progress=False, plots=False)
    path = tmp_path / "out" / runner.RECORDS
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    # interruption: two records complete, the third half-written
    path.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    partial = runner.run_bench(cfg, tiny, progress=False, plots=False, generate=False)
    assert partial["progress"] == {"generations": 2, "planned": 4}
    assert "partial run" in (tmp_path / "out" / "report.md").read_text()
    ran = []
    real = runner._run_one

    def spy(config, m, label, p, turn, rep, done, tok):
        ran.append((p.qid, label))
        return real(config, m, label, p, turn, rep, done, tok)

    monkeypatch.setattr(runner, "_run_one", spy)
    res = runner.run_bench(cfg, tiny, progress=False, plots=False)
    first_two = {(json.loads(x)["qid"], json.loads(x)["method"]) for x in lines[:2]}
    assert len(ran) == 2 and not set(ran) & first_two
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(recs) == 4
    assert len({(r["qid"], r["method"]) for r in recs}) == 4
    assert all(m["overall"]["n"] == 2 for m in res["methods"])
    assert res["progress"] == {"generations": 4, "planned": 4}
    assert "partial run" not in (tmp_path / "out" / "report.md").read_text()
    # a complete rerun generates nothing
    ran.clear()
    runner.run_bench(cfg, tiny, progress=False, plots=False)
    assert ran == []
    # a record written twice (e.g. by a stray second process) counts once, the last wins
    dup = json.loads(lines[0])
    dup["decode_time"] = 1e6
    with open(path, "a") as f:
        f.write(json.dumps(dup) + "\n")
    res = runner.run_bench(cfg, tiny, progress=False, plots=False, generate=False)
    assert all(m["overall"]["n"] == 2 for m in res["methods"])
    row = next(m for m in res["methods"] if m["label"] == dup["method"])
    assert row["overall"]["decode_time_s"] >= 1e6


def test_other_settings_refused_unless_overwrite(tiny, tmp_path):
    cfg = _cfg(tmp_path, methods=parse_methods("ntp"), categories=["qa"], max_tokens=4)
    runner.run_bench(cfg, tiny, progress=False, plots=False)
    other = _cfg(tmp_path, methods=parse_methods("ntp"), categories=["qa"], max_tokens=5)
    with pytest.raises(InvalidArgumentError, match="different settings.*max_tokens"):
        runner.run_bench(other, tiny, progress=False, plots=False)
    res = runner.run_bench(other, tiny, overwrite=True, progress=False, plots=False)
    assert res["settings"]["max_tokens"] == 5
    assert res["methods"][0]["overall"]["generated_tokens"] <= 5


def test_second_turn_uses_ntp_answer(tiny, tmp_path):
    cfg = _cfg(tmp_path, categories=["writing"], turns=2, max_tokens=6)
    res = runner.run_bench(cfg, tiny, progress=False, plots=False)
    recs = [json.loads(x) for x in (tmp_path / "out" / runner.RECORDS).read_text().splitlines()]
    assert sorted((r["turn"], r["method"]) for r in recs) == [
        (1, "ntp"),
        (1, "pld"),
        (2, "ntp"),
        (2, "pld"),
    ]
    t1 = next(r for r in recs if r["turn"] == 1 and r["method"] == "ntp")
    t2 = [r for r in recs if r["turn"] == 2]
    assert all(r["prompt_tokens"] > t1["prompt_tokens"] + t1["generated_tokens"] for r in t2)
    assert res["methods"][1]["exactness"]["checked"] == 2


def test_gsm8k_mode(tiny, tmp_path):
    data = tmp_path / "gsm.jsonl"
    data.write_text(
        json.dumps({"question": "What is 2 plus 3?", "answer": "2+3=5\n#### 5"})
        + "\n"
        + json.dumps({"question": "What is 10 minus 4?", "answer": "#### 6"})
        + "\n"
    )
    cfg = _cfg(
        tmp_path,
        mode="gsm8k",
        gsm8k=str(data),
        categories=None,
        limit=2,
        temp=0.7,
        seed=1,
        methods=parse_methods("ntp,lookahead"),
    )
    res = runner.run_bench(cfg, tiny, progress=False)
    assert res["tasks"] == ["gsm8k"]
    for m in res["methods"]:
        assert 0.0 <= m["overall"]["accuracy"] <= 1.0
        assert m["exactness"] is None  # not checked at temp > 0
    assert {p["gold"] for p in res["prompts"]} == {"5", "6"}
    assert (tmp_path / "out" / "accuracy_vs_tau.png").exists()
    assert "Accuracy" in (tmp_path / "out" / "report.md").read_text()
    with pytest.raises(InvalidArgumentError, match="not found"):
        runner.run_bench(
            _cfg(
                tmp_path, mode="gsm8k", gsm8k=str(tmp_path / "none.jsonl"), out=str(tmp_path / "o2")
            ),
            tiny,
            progress=False,
        )


def test_gsm8k_default_is_found_under_mlx_mtp_data_or_asked_for(tmp_path, monkeypatch):
    """GSM8K is not shipped: without --gsm8k the bench reads gsm8k/test.jsonl
    under $MLX_MTP_DATA, and without that says to give --gsm8k."""
    monkeypatch.delenv("MLX_MTP_DATA", raising=False)
    cfg = _cfg(tmp_path, mode="gsm8k", categories=None)
    with pytest.raises(InvalidArgumentError, match="pass --gsm8k PATH.*MLX_MTP_DATA"):
        runner._gsm8k_prompts(cfg)
    test = tmp_path / "gsm8k" / "test.jsonl"
    test.parent.mkdir()
    test.write_text(json.dumps({"question": "What is 2 plus 3?", "answer": "#### 5"}) + "\n")
    monkeypatch.setenv("MLX_MTP_DATA", str(tmp_path))
    assert [p.answer for p in runner._gsm8k_prompts(cfg)] == ["#### 5"]


def test_report_only_needs_records(tmp_path):
    with pytest.raises(InvalidArgumentError, match="no finished generations"):
        runner.run_bench(_cfg(tmp_path), None, progress=False, generate=False)


def test_bad_inputs(tmp_path):
    with pytest.raises(InvalidArgumentError, match="unknown nope"):
        runner.select_prompts(_cfg(tmp_path, categories=["nope"]))
    with pytest.raises(InvalidArgumentError, match="no such file"):
        runner.select_prompts(_cfg(tmp_path, questions=str(tmp_path / "q.jsonl")))
    prompts, groups = runner.select_prompts(_cfg(tmp_path, categories=None, limit=2))
    assert len(prompts) == 12 and len(groups) == 6
    assert [p.task for p in prompts[:6]] == groups  # round-robin over tasks


def test_cli_reports_bad_method_spec(tmp_path):
    from typer.testing import CliRunner

    from mlx_mtp.cli import app

    r = CliRunner().invoke(app, ["bench", "--methods", "probe:bc", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0
    assert isinstance(r.exception, InvalidArgumentError)
    assert "key=value" in str(r.exception)


def test_mlx_lm_peer_row(tiny, tmp_path):
    """The ``mlx_lm`` row runs mlx-lm's own stream_generate on the same model and
    prompts, interleaved; in float32 its greedy tokens equal ntp's; every method
    gets a speedup against it too."""
    cfg = _cfg(tmp_path, methods=parse_methods("ntp,mlx_lm,pld"))
    res = runner.run_bench(cfg, tiny, progress=False, plots=False)
    assert [m["label"] for m in res["methods"]] == ["ntp", "mlx_lm", "pld"]
    ntp, peer, pld = res["methods"]
    assert peer["exactness"] == {"checked": 2, "exact": 2, "agreement": 1.0, "mismatches": []}
    assert peer["overall"]["tau"] == 1.0
    assert peer["overall"]["generated_tokens"] == ntp["overall"]["generated_tokens"]
    assert peer["describe"].startswith("mlx_lm.stream_generate")
    for m in res["methods"]:
        o = m["overall"]
        assert o["speedup_vs_mlx_lm"] == pytest.approx(
            o["decode_tps"] / peer["overall"]["decode_tps"]
        )
        assert all("speedup_vs_mlx_lm" in t for t in m["tasks"].values())
    assert peer["overall"]["speedup_vs_mlx_lm"] == pytest.approx(1.0)
    assert all("speedup_vs_mlx_lm" in p for p in res["prompts"])
    recs = [json.loads(x) for x in (tmp_path / "out" / runner.RECORDS).read_text().splitlines()]
    assert [r["method"] for r in recs] == ["ntp", "mlx_lm", "pld"] * 2  # interleaved
    assert all(r["decode_time"] > 0 and r["prefill_time"] >= 0 for r in recs)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| Overall | Overall vs mlx_lm | Mean accepted tokens (tau) |" in report
    assert "| mlx_lm | 1 |" in report
    with pytest.raises(InvalidArgumentError, match="takes no settings"):
        runner.run_bench(
            _cfg(tmp_path, methods=parse_methods("ntp,mlx_lm:bc=3"), out=str(tmp_path / "o2")),
            tiny,
            progress=False,
        )


def test_mlx_lm_peer_emits_the_stopping_eos_like_ntp(smollm):
    from mlx_mtp.api import MTPModel
    from mlx_mtp.bench.peer import MLXLMPeer
    from mlx_mtp.methods.ntp import NTP

    ids = runner.render_prompt(smollm.tokenizer, [{"role": "user", "content": "Say hi."}])
    ref = MTPModel(smollm, NTP()).generate(ids, max_tokens=40)
    got = MLXLMPeer().bind(smollm).generate(ids, max_tokens=40)
    assert ref.finish_reason == "stop"  # the answer is short: EOS inside the limit
    assert got.tokens == ref.tokens and got.finish_reason == "stop"
    assert got.text == ref.text
    assert got.stats.prefill_tokens == len(ids) - 1 and got.stats.decode_time > 0
    short = MLXLMPeer().bind(smollm).generate(ids, max_tokens=3)
    assert short.tokens == ref.tokens[:3] and short.finish_reason == "length"


def test_interleave_runs_methods_step_by_step(smollm, tmp_path, monkeypatch):
    """``--interleave``: the methods of a prompt advance one decoding step each in
    turn, every step timed alone. Same tokens as the prompt-by-prompt run (float32
    greedy: exact), the peer generated alone, and a method's decode time holds
    its own steps only: pld's steps are slowed by a sleep, which must show in
    pld's time and not in ntp's, and ntp's pipelined forward pass (queued at the
    end of its step) must not be charged to the next method."""
    import time as _time

    from typer.testing import CliRunner

    from mlx_mtp.cli import app
    from mlx_mtp.sources.lookup import LookupDrafter

    runner.run_bench(
        _cfg(tmp_path, methods=parse_methods("ntp,pld"), out=str(tmp_path / "plain")),
        smollm,
        progress=False,
        plots=False,
    )
    nap = 0.5  # long beside ntp's steps, even on a loaded machine
    real_learn = LookupDrafter.learn

    def slow_learn(self, *args):  # every pipelined pld step learns once
        _time.sleep(nap)
        return real_learn(self, *args)

    monkeypatch.setattr(LookupDrafter, "learn", slow_learn)
    cfg = _cfg(  # pld's pipelined steps, on any device
        tmp_path, methods=parse_methods("ntp,mlx_lm,pld"), interleave=True, runner="pipelined"
    )
    res = runner.run_bench(cfg, smollm, progress=False, plots=False)
    out = tmp_path / "out"
    recs = [json.loads(x) for x in (out / runner.RECORDS).read_text().splitlines()]
    assert [r["method"] for r in recs] == ["ntp", "mlx_lm", "pld"] * 2
    assert [r["runner"] for r in recs] == ["plain", "mlx-lm", "pipelined"] * 2
    assert [m["runner"] for m in res["methods"]] == ["plain", "mlx-lm", "pipelined"]
    assert res["settings"]["runner"] == "pipelined"
    plain_recs = (tmp_path / "plain" / runner.RECORDS).read_text().splitlines()
    ref = {r["qid"]: r["tokens"] for r in map(json.loads, plain_recs) if r["method"] == "ntp"}
    assert all(r["tokens"] == ref[r["qid"]] for r in recs)
    for m in res["methods"][1:]:
        assert m["exactness"]["exact"] == m["exactness"]["checked"] == 2, m["label"]
    for r in recs:
        assert r["decode_time"] > 0 and 0 <= r["forward_time"] <= r["decode_time"]
    by = {(r["qid"], r["method"]): r for r in recs}
    for qid in ref:
        ntp, pld = by[(qid, "ntp")], by[(qid, "pld")]
        slept = nap * pld["steps"]
        assert pld["decode_time"] >= slept
        # ntp's time would hold about half of pld's naps if the steps were not
        # timed apart (its step is idle while pld sleeps)
        assert ntp["decode_time"] < pld["decode_time"] - 0.8 * slept
    assert json.loads((out / runner.SETTINGS).read_text())["interleave"] is True
    assert "interleave" not in json.loads((tmp_path / "plain" / runner.SETTINGS).read_text())
    assert "step by step" in (out / "report.md").read_text()
    # the CLI flag is part of the settings: the same run resumes only with it
    args = ["bench", "--methods", "ntp,mlx_lm,pld", "--categories", "qa,translation",
            "--limit", "1", "-n", "8", "--dtype", "float32", "--out", str(out),
            "--report-only", "--no-plots", "--runner", "pipelined"]  # fmt: skip
    r = CliRunner().invoke(app, [*args, "--interleave"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, args)
    assert isinstance(r.exception, InvalidArgumentError)
    assert "differs in: interleave" in str(r.exception)
    r = CliRunner().invoke(app, [*args[:-2], "--interleave"])  # --runner is a setting too
    assert "differs in: runner" in str(r.exception)
    monkeypatch.setattr(runner.distributed, "size", lambda: 2)
    with pytest.raises(InvalidArgumentError, match="--interleave runs on one process"):
        runner.run_bench(cfg, smollm, progress=False, plots=False)


def test_mlx_lm_draft_row_and_draft_rows_take_the_draft_model(smollm, tmp_path):
    """``mlx_lm_draft:k=2`` runs mlx-lm's draft-model speculation; ``draft``
    rows get ``--draft-model`` too; both equal ntp's tokens in float32 (here the
    model drafts for itself: every draft is right) and every method gets a
    speedup against the fastest mlx_lm_draft row."""
    methods = parse_methods("ntp,mlx_lm_draft:k=2,draft:shape=chain,num_draft_tokens=2,draft")
    cfg = _cfg(tmp_path, methods=methods, draft_model="smollm2-135m")
    res = runner.run_bench(cfg, smollm, progress=False, plots=False)
    by = {m["label"]: m for m in res["methods"]}
    peer = by["mlx_lm_draft:k=2"]
    assert "num_draft_tokens=2" in peer["describe"]
    for label in ("mlx_lm_draft:k=2", "draft:shape=chain,num_draft_tokens=2", "draft"):
        m = by[label]
        assert m["exactness"]["exact"] == m["exactness"]["checked"] == 2, label
        assert "speedup_vs_mlx_lm_draft" in m["overall"]
    # a perfect draft is accepted (``draft`` at auto drafts only where a draft
    # model as dear as the target pays on this machine's curve, which it may not)
    for label in ("mlx_lm_draft:k=2", "draft:shape=chain,num_draft_tokens=2"):
        assert by[label]["overall"]["tau"] > 1.5, label
    assert "Overall vs mlx_lm_draft" in (tmp_path / "out" / "report.md").read_text()
    # the same chain, every draft right: both loops pass the target as often
    # (mlx-lm's last step, cut by max_tokens, yields no bonus token but is a pass)
    chain = by["draft:shape=chain,num_draft_tokens=2"]
    assert peer["overall"]["forward_passes"] == chain["overall"]["forward_passes"]
    # mlx-lm's draft loop takes no progress callback: its prefill (both
    # models) is still split from its decode time, as the draft rows' is
    recs = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").open()]
    pre = {(r["qid"], r["method"]): r["prefill_time"] for r in recs}
    for qid in {r["qid"] for r in recs}:
        draft = pre[(qid, "draft:shape=chain,num_draft_tokens=2")]
        assert pre[(qid, "mlx_lm_draft:k=2")] > 0.3 * draft > 0, qid
    with pytest.raises(InvalidArgumentError, match="needs a draft model"):
        runner.run_bench(
            _cfg(tmp_path, methods=parse_methods("ntp,mlx_lm_draft"), out=str(tmp_path / "o2")),
            smollm,
            progress=False,
        )


def test_interleave_on_a_simulated_device_counts_its_passes_not_this_cpus(
    smollm, tmp_path, monkeypatch
):
    """Under ``MLX_MTP_SIMULATE_DEVICE`` the interleaved bench times ntp at the
    simulated 12 ms per token plus its host work: the wait for the pass an ntp
    step leaves queued is the simulated device's, not this CPU's compute of it.
    (SmolLM2's real pass is measured here first: if this CPU's compute leaked
    into the figure, a token would take at least that long.)"""
    import time as _time

    import mlx.core as mx

    from mlx_mtp.engine import Engine

    eng = Engine(smollm.model)
    eng.sync(list(range(10, 40)))
    t0 = _time.perf_counter()
    for t in range(5):
        mx.eval(eng.forward_chain([t + 50])[0])
    real = (_time.perf_counter() - t0) / 5
    monkeypatch.setenv("MLX_MTP_SIMULATE_DEVICE", "ms_per_token=12,curve=1:1,16:1.05,64:1.3")
    cfg = _cfg(tmp_path, methods=parse_methods("ntp,pld"), interleave=True, max_tokens=24)
    runner.run_bench(cfg, smollm, progress=False, plots=False)
    recs = [json.loads(x) for x in (tmp_path / "out" / runner.RECORDS).read_text().splitlines()]
    for r in recs:
        if r["method"] == "ntp":
            per_token = r["decode_time"] / r["generated_tokens"]
            assert per_token >= 0.0119, per_token  # never faster than the device
            if real > 0.024:  # this CPU's pass is clearly slower than the device's
                assert per_token < (0.012 + real) / 2, (per_token, real)


def test_a_profile_sweep_reports_every_methods_speedup_per_profile(tiny, tmp_path, monkeypatch):
    """``--profiles``: one run per simulated device profile in its own
    subfolder (the model loaded once), and a method x profile table of
    speedups in the sweep's report.md and results.json."""
    import re

    from typer.testing import CliRunner

    from mlx_mtp.bench.report import SWEEP_SCHEMA
    from mlx_mtp.cli import app

    names = ["bf16-flat", "m4pro-4bit"]
    cfg = _cfg(tmp_path, categories=["qa"], interleave=True)  # ntp,pld; 1 prompt, 8 tokens
    sweep = runner.run_sweep(cfg, names, 12, tiny, progress=False, plots=False)
    out = tmp_path / "out"
    assert sweep["schema"] == SWEEP_SCHEMA
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(sweep))
    assert [p["name"] for p in sweep["profiles"]] == names
    assert sweep["settings"]["profiles"] == names and "device" not in sweep["settings"]
    by = {m["label"]: m for m in sweep["methods"]}
    assert list(by) == ["ntp", "pld"]
    for m in by.values():
        assert all(m["by_profile"][n]["speedup"] > 0 for n in names), m
    assert by["ntp"]["by_profile"]["m4pro-4bit"]["speedup"] == pytest.approx(1.0)
    for n in names:  # each profile a whole run, on its own device
        sub = json.loads((out / n / "results.json").read_text())
        device = f"profile={n},ms_per_token=12"
        assert sub["environment"]["simulated_device"] == sub["settings"]["device"] == device
        assert sub["progress"] == {"generations": 2, "planned": 2}
    report = (out / "report.md").read_text()
    assert "| Method | bf16-flat | m4pro-4bit |" in report
    assert re.search(r"\| pld \| \d+\.\d\dx \| \d+\.\d\dx \|", report), report
    # the flag: --report-only rebuilds the same table from the subfolders
    args = ["bench", "--methods", "ntp,pld", "--categories", "qa", "--limit", "1", "-n", "8",
            "--dtype", "float32", "--interleave", "--out", str(out), "--no-plots",
            "--profiles", ",".join(names)]  # fmt: skip
    r = CliRunner().invoke(app, [*args, "--report-only"])
    assert r.exit_code == 0, r.output
    assert (out / "report.md").read_text() == report.replace(
        re.search(r"\d{4}-\d\d-\d\dT[\d:]+Z", report)[0],
        re.search(r"\d{4}-\d\d-\d\dT[\d:]+Z", (out / "report.md").read_text())[0],
    )
    r = CliRunner().invoke(app, [*args[:-1], "bf16-flat,m5-2bit", "--report-only"])
    assert isinstance(r.exception, InvalidArgumentError)
    msg = str(r.exception)
    assert msg.startswith("--profiles: unknown device profile 'm5-2bit'") and "m3ultra-4bit" in msg
    monkeypatch.setenv("MLX_MTP_SIMULATE_DEVICE", "profile=bf16-flat,ms_per_token=12")
    r = CliRunner().invoke(app, [*args, "--report-only"])
    assert "unset MLX_MTP_SIMULATE_DEVICE" in str(r.exception)


@pytest.mark.parametrize(
    ("argv", "limit", "says"),
    [
        ([], 3, "the first 3 prompts per category"),
        (["--mode", "gsm8k"], 18, "the first 18 GSM8K questions"),
        (["--limit", "all"], None, None),
        (["--limit", "5"], 5, None),
    ],
    ids=["default", "gsm8k", "all", "five"],
)
def test_bench_runs_a_sample_unless_told_all(tmp_path, capsys, monkeypatch, argv, limit, says):
    """Without --limit the bench runs a laptop-sized sample and says so on
    stderr; --limit all runs every prompt."""
    from conftest import run_cli

    seen = []

    def fake_run_bench(cfg, **kw):
        seen.append(cfg.limit)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_bench", fake_run_bench)
    code, err = run_cli(["bench", "--no-plots", "--out", str(tmp_path / "o"), *argv], capsys)
    assert code == 130 and seen == [limit], err
    assert (says is None) == ("--limit all" not in err), err
    if says:
        assert says in err and "x 256 tokens per method" in err, err


def test_bench_refuses_a_bad_limit(tmp_path, capsys):
    from conftest import run_cli

    for bad in ("0", "some"):
        code, err = run_cli(["bench", "--limit", bad, "--out", str(tmp_path / "o")], capsys)
        assert code != 0 and "--limit must be an integer > 0 or 'all'" in err, err
