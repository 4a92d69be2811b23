"""The server's bounds on requests (:mod:`mlx_mtp.server.limits`): every method
option classified as a value or a file, paths checked against
``--allow-artifacts``, and the bound on one forward pass measured from this
device's own timings, never extrapolated (SmolLM2-135M float32 for the real
measurement; a simulated device for the search itself)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlx_mtp.budget import CostCurve
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import METHODS, method_class, method_options
from mlx_mtp.server import limits as L
from mlx_mtp.server.protocol import OpenAIError


def test_every_method_option_is_classified():
    """A new option must be declared a value or a file/repo before requests
    can send it: this fails until it is."""
    seen = {o for name in METHODS for o in method_options(method_class(name))}
    assert not (L.ARTIFACT_OPTIONS & L.VALUE_OPTIONS)
    assert seen <= L.ARTIFACT_OPTIONS | L.VALUE_OPTIONS, seen - L.VALUE_OPTIONS
    assert {"heads", "adapter"} <= seen


# ------------------------------------------------------------------ artifacts
@pytest.fixture
def allowed(tmp_path):
    root = tmp_path / "allowed"
    (root / "heads").mkdir(parents=True)
    (root / "file.safetensors").write_bytes(b"x")
    (root / "to-etc").symlink_to("/etc")
    (tmp_path / "outside").mkdir()
    (root / "to-outside").symlink_to(tmp_path / "outside")
    (root / "inner").symlink_to(root / "heads")
    return root


def test_no_artifacts_by_default():
    with pytest.raises(OpenAIError) as e:
        L.Limits().request_options("clp", {"heads": "/tmp", "k": 2})
    assert e.value.code == "artifact_not_allowed" and "--allow-artifacts" in e.value.message
    assert L.Limits().request_options("probe", {"bc": 10}) == {"bc": 10}


@pytest.mark.parametrize(
    "value,ok",
    [
        ("heads", True),
        ("{root}/heads", True),
        ("{root}/file.safetensors", True),
        ("inner", True),  # a link that stays inside
        ("{root}", True),
        ("to-etc", False),
        ("to-outside", False),
        ("../outside", False),
        ("{root}/../outside", False),
        ("/etc", False),
        ("missing", False),
        ("org/name", False),  # a hub repo id is never taken from a request
        ("", False),
        ("a\x00b", False),
        (3, False),
    ],
)
def test_artifact_paths_must_lie_inside_an_allowed_folder(allowed, value, ok):
    lim = L.Limits(allow_artifacts=(allowed,))
    v = value.format(root=allowed) if isinstance(value, str) else value
    if ok:
        got = lim.request_options("mtp", {"heads": v})["heads"]
        assert os.path.isabs(got) and Path(got).exists()
        real = Path(os.path.realpath(allowed))
        assert Path(got) == real or real in Path(got).parents
    else:
        with pytest.raises(OpenAIError) as e:
            lim.request_options("mtp", {"heads": v})
        assert e.value.code == "artifact_not_allowed"
        assert str(allowed) not in e.value.message  # nothing about what exists


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"max_bc": 0}, "--max-bc"),
        ({"max_tokens": -1}, "--max-tokens"),
        ({"max_bc": True}, "--max-bc"),
        ({"max_forward_s": 0}, "--max-forward-s"),
        ({"max_forward_s": float("inf")}, "--max-forward-s"),
        ({"allow_artifacts": ("/no/such/folder",)}, "--allow-artifacts"),
    ],
)
def test_limits_refuse_bad_settings(kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        L.Limits(**kwargs)


def test_defaults_follow_the_servers_own_settings():
    lim = L.Limits()
    lim.resolve(default_bc=100, default_max_tokens=512)
    assert (lim.max_bc, lim.max_tokens) == (100, L.DEFAULT_MAX_TOKENS_LIMIT)
    lim = L.Limits(max_bc=8)
    lim.resolve(default_bc=100, default_max_tokens=9000)
    assert (lim.max_bc, lim.max_tokens) == (8, 9000)


# ------------------------------------------------------ forward-pass bound
def test_largest_within_interpolates_between_measured_sizes():
    times = {1: 0.1, 8: 0.2, 16: 0.4, 32: 1.2}
    assert L._largest_within(times, 10.0) == (32, 1.2)
    assert L._largest_within(times, 0.4) == (16, 0.4)
    n, t = L._largest_within(times, 0.8)  # halfway from 16 to 32
    assert n == 24 and abs(t - 0.8) < 1e-9
    assert L._largest_within(times, 0.15)[0] == 4


class FakeEngine:
    """What measure_forward_bounds reads of an engine, on a simulated device."""

    backbone = object()
    rollback = None
    offset = 0

    def __init__(self, memory_slots: int):
        self.memory_slots = memory_slots

    def max_slots(self, context: int = 0) -> int:
        return self.memory_slots


def test_the_bound_search_times_nothing_past_the_first_size_over_it(monkeypatch):
    """A device whose pass time grows with the square of its slots
    (``t(n) = 0.01 (1 + n / 16)^2`` s): sizes double past 64 until one is
    over the bound, and none larger is ever timed."""
    timed: list[int] = []

    def t(n: float) -> float:
        return 0.01 * (1 + n / 16) ** 2

    def fake_measure(engine, sizes, repeats):
        sizes = [s for s in sorted({1, *sizes}) if s <= engine.max_slots()]
        timed.extend(s for s in sizes if s > 1)
        return CostCurve(sizes, [t(s) / t(1) for s in sizes], seconds=t(1))

    monkeypatch.setattr(L, "measure_cost_curve", fake_measure)
    monkeypatch.setattr(L, "_prefill_bound", lambda engine, seconds, most: (most, 0.0))
    b = L.measure_forward_bounds(FakeEngine(100_000), seconds=1.0, most_slots=7000)
    # t(n) = 1.0 at n = 144: measured 64 (0.25 s), 128 (0.81 s), 256 (2.89 s): stop
    assert max(timed) == 256 and 512 not in timed
    assert 128 <= b.slots < 256 and b.slot_seconds <= 1.0
    # memory is a bound too, and a bound never above what was asked
    timed.clear()
    assert L.measure_forward_bounds(FakeEngine(40), 1.0, 7000).slots == 40
    assert max(timed) <= 40
    assert L.measure_forward_bounds(FakeEngine(100_000), 100.0, 48).slots == 48
    # a device on which even one token is over the bound
    with pytest.raises(InvalidArgumentError, match="One forward pass of one token"):
        L.measure_forward_bounds(FakeEngine(100), seconds=0.001, most_slots=64)


def test_the_bound_on_this_device(smollm):
    """Measured for real: generous bounds keep every size; the prefill chunk
    is timed too; the engine's cache is left as it was."""
    from mlx_mtp.engine import Engine

    eng = Engine(smollm.model)
    eng.sync(list(range(1, 40)))
    before = list(eng.cached)
    b = L.measure_forward_bounds(eng, seconds=60.0, most_slots=64, most_prefill=512)
    assert b.slots == 64 and set(b.measured) >= {1, 2, 16, 64}
    assert b.prefill_step == 512 and 0 < b.prefill_seconds < 60
    assert eng.cached == before and eng.forward_passes == 0  # nothing left behind
    lim = L.Limits(max_bc=64, max_forward_s=60.0, forward=b)
    assert lim.slots == 64 and lim.prefill_step == 512
    assert lim.slot_problem(64) is None and "64 slots (--max-bc)" in lim.slot_problem(65)


def test_the_bound_reads_the_devices_cost_curve_where_it_knows_the_time(monkeypatch):
    """With this device's cost curve and its one-slot time (what
    ``device_curves`` keeps), passes up to 64 slots are not timed again."""
    from mlx_mtp.budget import CostCurves
    from mlx_mtp.costs import LiveCurves

    timed: list[int] = []

    def fake_measure(engine, sizes, repeats):
        timed.extend(sizes)
        return CostCurve([1, *[s for s in sizes if s > 1]], [1.0] * len(set(sizes)), seconds=0.01)

    monkeypatch.setattr(L, "measure_cost_curve", fake_measure)
    monkeypatch.setattr(L, "_prefill_bound", lambda engine, seconds, most: (most, 0.0))
    curve = CostCurve([1, 8, 64], [1.0, 2.0, 9.0], seconds=0.1)  # 0.1 s, 0.2 s, 0.9 s
    live = LiveCurves(CostCurves([curve]), learn=False)
    b = L.measure_forward_bounds(FakeEngine(1000), seconds=0.5, most_slots=64, curves=live)
    assert timed == [] and b.slots == 8 + int((0.5 - 0.2) / 0.7 * 56)
    # a pinned curve has no time: then it is measured
    pinned = LiveCurves(CostCurves([CostCurve([1, 64], [1.0, 1.0])]), learn=False)
    L.measure_forward_bounds(FakeEngine(1000), seconds=0.5, most_slots=64, curves=pinned)
    assert 64 in timed
