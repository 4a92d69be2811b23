"""Named simulated devices (mlx_mtp.bench.profiles): parsing, and the derived
curves against the published matmul timings they come from."""

from __future__ import annotations

import pytest

from mlx_mtp.bench import profiles
from mlx_mtp.bench.simulate import simulated_device
from mlx_mtp.budget import parse_curve
from mlx_mtp.errors import InvalidArgumentError

#: the derived curves are rounded to 3 decimals
TOL = 0.002


def test_a_profile_is_a_device_spec_and_an_unknown_one_lists_the_known():
    per_token, curve = simulated_device("profile=m4pro-4bit,ms_per_token=12")
    assert per_token == pytest.approx(0.012)
    assert curve.costs == parse_curve(profiles.PROFILES["m4pro-4bit"]).costs
    # any order; bf16-flat is the hand-given curve of the other form
    _, flat = simulated_device("ms_per_token=12,profile=bf16-flat")
    assert flat(16) == pytest.approx(1.05) and flat(64) == pytest.approx(1.3)
    with pytest.raises(InvalidArgumentError) as e:
        simulated_device("profile=m5-2bit,ms_per_token=12")
    msg = str(e.value)
    assert "\n" not in msg and "'m5-2bit'" in msg
    assert all(name in msg for name in profiles.PROFILES)
    for bad in ("profile=bf16-flat", "profile=bf16-flat,ms_per_token=12,curve=1:1"):
        with pytest.raises(InvalidArgumentError, match="MLX_MTP_SIMULATE_DEVICE"):
            simulated_device(bad)


@pytest.mark.parametrize("name", sorted(profiles.PROFILES))
def test_every_profile_is_monotone_from_one(name):
    curve = parse_curve(profiles.PROFILES[name])
    costs = [curve(n) for n in range(1, 65)]
    assert costs[0] == 1.0
    assert all(b >= a for a, b in zip(costs, costs[1:])), name


def test_matmul_cost_is_the_published_points_and_the_kernel_steps():
    pts = {2: 1.03, 3: 1.22, 4: 1.47, 6: 2.07, 8: 2.69}
    for rows, cost in pts.items():
        assert profiles.matmul_cost(pts, rows, 10, 4.5) == pytest.approx(cost)
    assert profiles.matmul_cost(pts, 5, 10, 4.5) == pytest.approx((1.47 + 2.07) / 2)
    assert profiles.matmul_cost(pts, 9, 10, 4.5) == pytest.approx(2.69 + 0.31)  # last slope
    # qmm from the qmv limit: one 32-row tile, two from 33 rows
    assert profiles.matmul_cost(pts, 10, 10, 4.5) == profiles.matmul_cost(pts, 32, 10, 4.5) == 4.5
    assert profiles.matmul_cost(pts, 33, 10, 4.5) == profiles.matmul_cost(pts, 64, 10, 4.5) == 9.0


def _shares(bits: int = 4) -> tuple[float, dict[str, float]]:
    """(flat share, matmul kind -> share) of a one-slot pass of Qwen3-4B."""
    m = profiles.QWEN3_4B
    per_weight = profiles.quantized_bytes_per_weight(bits)
    total = sum(m.weights().values()) * per_weight + m.cache_bytes()
    return m.cache_bytes() / total, {k: v * per_weight / total for k, v in m.weights().items()}


def test_the_m3_ultra_curve_is_the_published_matmul_diluted_by_the_flat_part():
    """One measured shape stands for every matmul (ml-explore/mlx#4265): at
    the rows it gives, c(n) = flat + (1 - flat) * published(n)."""
    flat, _ = _shares()
    assert 0.05 < flat < 0.08  # the KV cache at 1,024 tokens
    curve = dict(profiles.forward_curve(profiles.M3ULTRA_4BIT, slots=(1, 2, 4, 7, 8, 16)))
    for rows, cost in {2: 1.83, 4: 3.26, 7: 5.28, 8: 6.12}.items():
        assert curve[rows] == pytest.approx(flat + (1 - flat) * cost, abs=TOL), rows
    # 16 rows: one qmm tile (6.32) for the MLP and the head, but the
    # attention projections still run qmv (their limit is 18), and the curve
    # keeps the dearer 11 rows' cost (monotone)
    assert curve[16] > flat + (1 - flat) * 6.32


def test_the_m4_pro_curve_weighs_each_kinds_published_points_by_its_bytes():
    """At the rows that ml-explore/mlx#3839 and #3852 both give (2, 3, 4, 8),
    c(n) is the flat share plus each kind's published cost times its share;
    and it lies between the cheapest and dearest kind there."""
    flat, share = _shares()
    assert share["mlp"] > 0.6 and 0.2 < share["attention"] < 0.25
    pub = {
        "attention": {2: 1.20, 3: 1.35, 4: 1.57, 8: 2.01},
        "mlp": {
            r: (2 * g + d) / 3
            for r, g, d in ((2, 1.03, 1.18), (3, 1.22, 1.40), (4, 1.47, 1.52), (8, 2.69, 2.46))
        },
        "lm_head": {2: 1.01, 3: 1.14, 4: 1.47, 8: 3.03},
    }
    curve = dict(profiles.forward_curve(profiles.M4PRO_4BIT, slots=(1, 2, 3, 4, 8)))
    for rows in (2, 3, 4, 8):
        want = flat + sum(share[k] * pub[k][rows] for k in pub)
        assert curve[rows] == pytest.approx(want, abs=TOL), rows
        lo, hi = (f(pub[k][rows] for k in pub) for f in (min, max))
        assert flat + (1 - flat) * lo - TOL <= curve[rows] <= flat + (1 - flat) * hi + TOL
    # from 12 rows every matmul runs one qmm tile (4.5x at 10 and 32 rows, #3852)
    full = dict(profiles.forward_curve(profiles.M4PRO_4BIT))
    assert full[12] == full[32] == pytest.approx(flat + (1 - flat) * 4.5, abs=TOL)
    assert full[33] == pytest.approx(flat + (1 - flat) * 9.0, abs=TOL)


def test_8bit_lies_between_flat_and_4bit():
    four = dict(profiles.forward_curve(profiles.M4PRO_4BIT))
    eight = dict(profiles.forward_curve(profiles.M4PRO_4BIT, bits=8))
    assert all(1.0 <= eight[n] <= four[n] for n in four)
    assert eight[2] == 1.0 and eight[8] > 1.1 and eight[64] < four[64]


def test_the_docs_table_is_the_computed_curves():
    """docs/profiles.md's table of curves is forward_curve's output."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "profiles.md").read_text()
    table = text.split("## The curves", 1)[1].split("\n\n", 2)[1].splitlines()
    names = [c.strip() for c in table[0].strip("|").split("|")][1:]
    assert names == list(profiles.PROFILES)
    curves = {n: parse_curve(profiles.PROFILES[n]) for n in names}
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [int(r[0]) for r in rows] == list(profiles.SLOTS)
    for r in rows:
        for name, cell in zip(names, r[1:]):
            assert float(cell) == pytest.approx(curves[name](int(r[0])), abs=0.0005), (name, r)
