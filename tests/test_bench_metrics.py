"""Benchmark metric functions and the --methods mini-language, on hand-made inputs."""

from __future__ import annotations

import math

import pytest

from mlx_mtp.bench import metrics
from mlx_mtp.bench.config import BenchConfig, parse_methods
from mlx_mtp.errors import InvalidArgumentError


def test_tau_and_forwards():
    assert metrics.tau(10, 10) == 1.0
    assert metrics.tau(15, 6) == 2.5
    assert metrics.tau(0, 0) == 0.0


def test_repetition_rate_known_values():
    # 4-grams of 1 2 3 4 1 2 3 4: 1234 2341 3412 4123 1234 -> 1 repeated of 5
    assert metrics.repetition_counts([1, 2, 3, 4, 1, 2, 3, 4]) == (1, 5)
    assert metrics.repetition_rate([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(0.2)
    # a constant run: every 4-gram after the first repeats
    assert metrics.repetition_rate([7] * 10) == pytest.approx(6 / 7)
    assert metrics.repetition_rate([1, 2, 3, 4, 5, 6]) == 0.0
    assert metrics.repetition_rate([1, 2, 3]) == 0.0
    assert metrics.repetition_counts([1, 1, 1], n=2) == (1, 2)


def test_first_mismatch():
    assert metrics.first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert metrics.first_mismatch([1, 2, 3], [1, 2]) == 2
    assert metrics.first_mismatch([], [4]) == 0


def test_speedup_is_ratio_of_aggregate_tokens_per_second():
    ref = [(100, 10.0), (50, 10.0)]  # 150 tokens in 20 s = 7.5 tok/s
    meth = [(100, 5.0), (50, 7.5)]  # 150 tokens in 12.5 s = 12 tok/s
    assert metrics.aggregate_speedup(ref, meth) == pytest.approx(12 / 7.5)
    # not the mean of per-prompt ratios (2.0 and 1.333 -> 1.667)
    assert metrics.aggregate_speedup(ref, meth) != pytest.approx((2.0 + 4 / 3) / 2)
    assert metrics.aggregate_speedup(ref, ref) == pytest.approx(1.0)
    assert math.isnan(metrics.aggregate_speedup([(1, 0.0)], meth))


def _rec(qid, tokens, fwd, secs, rep=(0, 1), **kw):
    return {
        "qid": qid,
        "turn": 1,
        "repeat": 0,
        "generated_tokens": tokens,
        "forward_passes": fwd,
        "decode_time": secs,
        "peak_memory_gb": 0.5,
        "rep_repeated": rep[0],
        "rep_total": rep[1],
        **kw,
    }


def test_summarize_aggregates_token_weighted():
    ref = [_rec("a", 100, 100, 10.0), _rec("b", 20, 20, 2.0)]
    meth = [_rec("a", 100, 40, 5.0, rep=(1, 97)), _rec("b", 20, 20, 2.0, rep=(2, 17))]
    s = metrics.summarize(meth, {metrics.record_key(r): r for r in ref})
    assert s["tau"] == pytest.approx(120 / 60)
    assert s["forwards_per_token"] == pytest.approx(0.5)
    assert s["decode_tps"] == pytest.approx(120 / 7.0)
    assert s["speedup"] == pytest.approx((120 / 7.0) / (120 / 12.0))
    assert s["repetition_rate"] == pytest.approx(3 / 114)
    assert "accuracy" not in s
    r = metrics.summarize(ref, {metrics.record_key(x): x for x in ref})
    assert r["tau"] == 1.0 and r["speedup"] == pytest.approx(1.0)


def test_summarize_host_ms_per_step():
    recs = [_rec("a", 10, 5, 1.0), _rec("b", 10, 5, 2.0)]
    assert metrics.summarize(recs)["host_ms_per_step"] is None  # older records: no forward_time
    recs[0].update(steps=5, forward_time=0.99)  # 10 ms outside the device over 5 steps
    recs[1].update(steps=5, forward_time=1.98)  # 20 ms over 5 steps
    assert metrics.summarize(recs)["host_ms_per_step"] == pytest.approx(3.0)
    assert metrics.summarize(recs)["slots_per_forward"] is None
    recs[0]["slots"], recs[1]["slots"] = 50, 10  # 60 slots over 10 forwards
    assert metrics.summarize(recs)["slots_per_forward"] == pytest.approx(6.0)
    assert metrics.summarize(recs)["plain_step_share"] is None  # older records
    recs[0]["plain_steps"], recs[1]["plain_steps"] = 4, 1  # 5 of 10 steps plain
    assert metrics.summarize(recs)["plain_step_share"] == pytest.approx(0.5)


def test_summarize_accuracy():
    recs = [_rec("a", 1, 1, 1.0, correct=True), _rec("b", 1, 1, 1.0, correct=False)]
    assert metrics.summarize(recs)["accuracy"] == 0.5


@pytest.mark.parametrize(
    "text,expected",
    [
        ("So the answer is 42.", "42"),
        ("3 apples and 1,234 pears", "1234"),
        ("costs $18.50 in total", "18.5"),
        ("we get -7", "-7"),
        ("total 12.0", "12"),
        ("no number here", None),
    ],
)
def test_extract_last_number(text, expected):
    assert metrics.extract_last_number(text) == expected


def test_gsm8k_correct():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert metrics.gsm8k_gold(answer) == "72"
    assert metrics.gsm8k_correct("48 + 24 = 72", answer) == (True, "72", "72")
    assert metrics.gsm8k_correct("The answer is 72 clips, or 3 boxes", answer)[0] is False
    assert metrics.gsm8k_correct("I don't know", answer) == (False, None, "72")
    assert metrics.gsm8k_gold("no marker") is None


def test_parse_methods_settings_and_commas():
    specs = parse_methods("pld,lookahead,probe:bc=30,masks=2,probe:bc=10")
    assert [s.label for s in specs] == [
        "ntp",
        "pld",
        "lookahead",
        "probe:bc=30,masks=2",
        "probe:bc=10",
    ]
    assert specs[3].name == "probe" and specs[3].options == {"bc": "30", "masks": "2"}
    assert specs[4].options == {"bc": "10"}
    # ntp moved first, not duplicated
    assert [s.label for s in parse_methods("pld,ntp")] == ["ntp", "pld"]
    assert parse_methods(" lookahead:level=4 , window=5 ")[1].options == {
        "level": "4",
        "window": "5",
    }


@pytest.mark.parametrize(
    "text", ["", "bc=30,probe", "probe:bc=30,probe:bc=30", "probe:bc", "probe:bc=1,bc=2", ":a=1"]
)
def test_parse_methods_errors(text):
    with pytest.raises(InvalidArgumentError):
        parse_methods(text)


def test_config_validation():
    BenchConfig().validate()
    for bad in (
        {"turns": 3},
        {"mode": "mmlu"},
        {"max_tokens": 0},
        {"limit": 0},
        {"repeats": 0},
        {"temp": -1.0},
        {"mode": "gsm8k", "turns": 2},
    ):
        with pytest.raises(InvalidArgumentError):
            BenchConfig(**bad).validate()


def test_prefix_agreement():
    assert metrics.prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert metrics.prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert metrics.prefix_agreement([1, 2, 3, 4], [1, 2]) == 0.5
    assert metrics.prefix_agreement([1, 2], [1, 2, 3]) == 1.0  # all of the reference
    assert metrics.prefix_agreement([], []) == 1.0


def test_bf16_report_gives_agreement_and_the_reason():
    """Outside float32 the exactness column reports token agreement with ntp
    and the report says why lossless methods may differ there."""
    from mlx_mtp.bench.report import build_results, render_markdown
    from mlx_mtp.methods import make_method

    cfg = BenchConfig(methods=parse_methods("ntp,pld"), dtype="bfloat16")
    methods = {s.label: make_method(s.name) for s in cfg.methods}

    def rec(qid, method, tokens):
        return {
            "qid": qid,
            "task": "qa",
            "category": "qa",
            "turn": 1,
            "repeat": 0,
            "method": method,
            "generated_tokens": len(tokens),
            "forward_passes": len(tokens),
            "decode_time": 1.0,
            "peak_memory_gb": 0.1,
            "rep_repeated": 0,
            "rep_total": 1,
            "tokens": tokens,
        }

    records = [
        rec("a", "ntp", [1, 2, 3, 4]),
        rec("a", "pld", [1, 2, 3, 4]),
        rec("b", "ntp", [5, 6, 7, 8, 9, 10]),
        rec("b", "pld", [5, 6, 0, 8, 9, 10]),
    ]
    res = build_results(cfg, methods, records, ["qa"], {})
    ex = res["methods"][1]["exactness"]
    assert ex["checked"] == 2 and ex["exact"] == 1
    assert ex["agreement"] == pytest.approx((4 + 2) / (4 + 6))
    assert [p.get("agreement") for p in res["prompts"] if p["method"] == "pld"] == [1.0, 2 / 6]
    md = render_markdown(res)
    assert "1/2, agreement 60.0%" in md
    assert "Computed in bfloat16" in md and "#1423" in md
