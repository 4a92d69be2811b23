"""The simulated device (mlx_mtp.bench.simulate.SimulatedClock): forward passes take
the simulated device's time, host work its real time, pipelined passes overlap
host work; and the planner's host term on it."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from conftest import decode, run_cli
from tiny_models import make_tiny_model

from mlx_mtp.bench.simulate import SimulatedClock, simulated_device
from mlx_mtp.budget import CostCurve
from mlx_mtp.context import Context
from mlx_mtp.engine import Engine
from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.methods import make_method

SPEC = "ms_per_token=12,curve=1:1,16:1.05,64:1.3"


def test_spec_parses_and_bad_specs_are_refused():
    per_token, curve = simulated_device(SPEC)
    assert per_token == pytest.approx(0.012) and curve(16) == pytest.approx(1.05)
    assert simulated_device("") is None
    for bad in ("ms_per_token=x,curve=1:1", "curve=1:1", "ms_per_token=12", "ms=12,curve=1:1"):
        with pytest.raises(InvalidArgumentError, match="MLX_MTP_SIMULATE_DEVICE"):
            simulated_device(bad)


def test_the_command_line_runs_on_the_simulated_device(monkeypatch, capsys, simulate):
    """``MLX_MTP_SIMULATE_DEVICE`` reaches every engine of an ``mlx-mtp``
    command (installed by the front end, not read on the decoding path): the
    stats line then has the simulated device's idle time; a malformed one is
    refused with exit status 2. (``simulate``: real clocks after the test.)"""
    argv = ["generate", "--model", "smollm2-135m", "--prompt", "Hi", "--max-tokens", "4"]
    code, err = run_cli(argv, capsys)
    assert code == 0 and "device idle" not in err
    monkeypatch.setenv("MLX_MTP_SIMULATE_DEVICE", SPEC)
    code, err = run_cli(argv, capsys)
    assert code == 0 and "device idle" in err, err
    monkeypatch.setenv("MLX_MTP_SIMULATE_DEVICE", "ms_per_token=fast")
    code, err = run_cli(argv, capsys)
    assert code == 2 and "MLX_MTP_SIMULATE_DEVICE" in err


def test_a_pass_takes_the_simulated_time_not_this_machines():
    clock = SimulatedClock(0.012, CostCurve([1, 16, 64], [1.0, 1.05, 1.3]))
    a = mx.random.normal((512, 512))
    # (lower bounds are exact; upper bounds leave room for this machine's own
    # Python time around the calls, which the virtual clock counts as host work)
    big = a @ a @ a
    t0 = clock.now()
    clock.finish(t0, [big], wait=True, slots=16)  # real compute: not counted
    assert 0.0126 <= clock.now() - t0 < 0.0126 + 0.005
    # host work counts as measured; a queued pass overlaps it
    t0 = clock.now()
    done = clock.launch([a @ a], 1)
    time.sleep(0.02)  # 20 ms of host work while the 12 ms pass runs
    clock.block(lambda: None, done)
    assert 0.02 <= clock.now() - t0 < 0.02 + 0.008  # max(host, device), not the sum
    t0 = clock.now()
    time.sleep(0.005)
    clock.finish(clock.now(), [a @ a], wait=True, slots=1)  # serial: host + device
    assert 0.017 <= clock.now() - t0 < 0.017 + 0.008


def test_plain_decoding_runs_at_the_simulated_speed(simulate):
    """ntp on the simulated 12 ms/token device runs at about 83 tok/s on the
    virtual clock, whatever this CPU takes per pass (the tiny model here)."""
    simulate(SPEC)
    engine = Engine(make_tiny_model("llama", seed=0))
    assert isinstance(engine.clock, SimulatedClock)
    out, stats = decode(engine, make_method("ntp"), [3, 5, 7, 9], 40)
    assert len(out) == 40
    assert 60 < stats.decode_tps <= 84  # host work of each step may show where it is longer


def test_lookahead_window_auto_counts_the_host_time_its_steps_measured(monkeypatch, simulate):
    """On a simulated fast device whose curve makes a 7-column window nearly
    free, lookahead's first generation runs the window; when its steps'
    host work (a sleep in every propose) is more than the window may cost,
    the next generation on the context runs no window, and stays exact."""
    from mlx_mtp.methods.lookahead import Lookahead

    simulate(SPEC)
    monkeypatch.setenv("MLX_MTP_HOST_TERM", "1")
    real = Lookahead.propose

    def slow(self, ctx, root):
        time.sleep(0.01)  # 10 ms of host work beside a 12 ms forward
        return real(self, ctx, root)

    monkeypatch.setattr(Lookahead, "propose", slow)
    model = make_tiny_model("llama", seed=0)
    prompt = [3, 5, 7, 9, 11, 13]
    ref = decode(Engine(model), make_method("ntp"), prompt, 24)[0]
    ctx = Context(Engine(model))
    m = make_method("lookahead")
    m.prepare(ctx)
    windows = []
    for _ in range(2):
        out, _ = decode(ctx, m, prompt, 24)
        assert out == ref
        windows.append(m.window)
    assert windows[0] > 0 and windows[1] == 0


def test_host_term_keeps_weak_drafts_off_a_fast_device(monkeypatch, simulate):
    """pld on a repetitive prompt, simulated fast device: with the host work
    of a draft step slowed (a sleep after each verification) the planner
    runs plain steps; with the host term off it drafts on and loses time."""
    from mlx_mtp.methods.pld import PLD

    simulate(SPEC)
    monkeypatch.setenv("MLX_MTP_PIPELINE", "0")  # the planner's steps
    real = PLD.observe

    def slow(self, ctx, draft, result):
        if draft is not None:
            time.sleep(0.02)  # 20 ms of host work: more than a 12 ms forward
        return real(self, ctx, draft, result)

    monkeypatch.setattr(PLD, "observe", slow)
    model = make_tiny_model("llama", seed=0)
    prompt = [3, 5, 7, 9] * 6
    runs = {}
    for term in ("1", "0"):
        monkeypatch.setenv("MLX_MTP_HOST_TERM", term)
        from mlx_mtp.costs import device_curves

        ctx = Context(Engine(model))
        assert device_curves(ctx.engine).t1 == pytest.approx(0.012)
        m = make_method("pld")
        m.prepare(ctx)
        runs[term] = decode(ctx, m, prompt, 48)[1]
    assert runs["1"].plain_steps > runs["0"].plain_steps
    assert runs["1"].decode_tps > runs["0"].decode_tps


def test_the_pipeline_restarts_without_waiting_for_the_roots_pass():
    """A plain step whose root's pass was not queued (after a draft step)
    starts that pass and builds the next token's pass while it runs: two
    launches, then one wait, as in a step of the steady state; it commits the
    same tokens as unpipelined steps."""
    from mlx_mtp.plain import PlainSteps

    model = make_tiny_model("llama", seed=3, tie_word_embeddings=False)
    prompt = [5, 17, 99, 3]
    events: list[str] = []

    class Spy(SimulatedClock):
        def launch(self, outputs, slots):
            events.append("launch")
            return super().launch(outputs, slots)

        def block(self, read, done=0.0):
            events.append("block")
            return super().block(read, done)

    runs = {}
    for queue in (True, False):
        eng = Engine(model)
        eng.clock = Spy(0.012, CostCurve([1, 64], [1.0, 1.3]))
        eng.sync(prompt[:-1])
        plain, root, out = PlainSteps(None), prompt[-1], []
        for i in range(6):
            if i == 3:  # a draft step ran: the queued pass is dropped
                plain.unqueue(eng, root)
            events.clear()
            out.append(plain.step(eng, root, queue_next=queue)[0])
            if queue and i in (0, 3):  # a restart: no wait before the next pass is queued
                assert events == ["launch", "launch", "block"], events
            root = out[-1]
        runs[queue] = out
    assert runs[True] == runs[False]


def test_a_draft_steps_host_work_and_the_restart_after_it_are_measured(simulate):
    """A draft step costs its host work and the pipeline's restart in the
    plain step after it. Where that step takes 30 ms more (a sleep in
    propose right after a draft step), the ledger measures it: each probe
    then loses 2.5 forwards more, and far fewer of them fit in the
    generation than without the sleep."""
    from mlx_mtp.methods.base import DraftMethod
    from mlx_mtp.offers import chain_offer

    class WrongChain(DraftMethod):
        """auto: a chain of wrong tokens (never accepted); ``pause`` seconds
        of host work in the proposal right after a draft step."""

        name, auto = "wrong-chain", True

        def __init__(self, pause: float):
            self.pause, self.last = pause, ""

        def propose(self, ctx, root):
            if self.last == "draft":
                time.sleep(self.pause)
            return chain_offer(root, [(root + 1) % 256] * 4, "oracle", ctx.acceptance)

        def observe(self, ctx, draft, result):
            self.last = "plain" if draft is None else "draft"

    simulate(SPEC)
    model = make_tiny_model("llama", seed=0)
    prompt = [3, 5, 7, 9, 11, 13]
    ref = decode(Engine(model), make_method("ntp"), prompt, 300)[0]
    probes = {}
    for pause in (0.0, 0.03):
        ctx, method = Context(Engine(model)), WrongChain(pause)
        out, stats = decode(ctx, method, prompt, 300)
        assert out == ref
        probes[pause] = stats.reprobes
    assert probes[0.03] <= 2 < 4 <= probes[0.0], probes


def test_step_times_net_the_stop_before_a_draft_step_against_the_restart_after_it():
    """A draft step's host sample is its wall time less the device time
    priced, plus what the stop before it took less than a plain step and
    the restart after it took more; the stop and restart leave the plain
    step's average alone, and a draft step without a stop before it has no
    lead."""
    from mlx_mtp.steptimes import StepTimes

    t = StepTimes()
    t.record("plain", 0.080)
    t.record("plain", 0.080, steady=False)  # a restart not after a draft step: not timed
    t.record("stop", 0.020)
    t.record("draft", 0.100, device=0.090)
    t.record("plain", 0.140)  # the restart: 60 ms over a plain step
    assert t.plain == pytest.approx(0.080) and t.host == pytest.approx(0.010 - 0.060 + 0.060)
    t.record("draft", 0.100, device=0.090)
    t.record("draft", 0.100, device=0.070)  # no restart between the two
    t.flush()
    assert t.host == pytest.approx(0.010 + 0.2 * (0.010 - 0.010) + 0.2 * (0.030 - 0.010))


def test_the_restart_after_drafts_that_open_a_generation_is_not_drafting_loss(
    simulate, monkeypatch
):
    """Plain decoding's first step starts the pipeline as the plain step
    after a draft step restarts it (on MLX's CPU backend each waits for two
    passes: ``examples/pipeline_stop.py``, SmolLM2 float32, 227-251 ms
    against 126-128 ms steady). A draft at a
    generation's first step leaves that start to plain decoding's account;
    the restart after a draft later in the generation, with the stop before
    it, is drafting's."""
    from mlx_mtp import planner
    from mlx_mtp.methods.base import DraftMethod
    from mlx_mtp.offers import chain_offer

    class Twice(DraftMethod):
        """auto: the reference's next three tokens at the first step and
        from the fourteenth token on, until a draft step sends them."""

        name, auto = "twice", True

        def __init__(self, ref):
            super().__init__()
            self.ref = ref

        def begin(self, ctx, prompt, sampler):
            self.seq, self.at = list(prompt), [len(prompt) + 14, len(prompt)]

        def propose(self, ctx, root):
            n = len(self.seq)
            guess = self.ref[n : n + 3] if self.at and n >= self.at[-1] else []
            return chain_offer(root, guess, "oracle", ctx.acceptance)

        def observe(self, ctx, draft, result):
            self.seq += result.tokens
            if draft is not None:
                self.at.pop()

    steps = []  # (kind, what the step added to the loss)
    real = planner.Planner.step

    def step(p, root):
        before = p.ledger.loss
        out = real(p, root)
        steps.append((p._kind, p.ledger.loss - before))
        return out

    monkeypatch.setattr(planner.Planner, "step", step)
    simulate(SPEC)
    model = make_tiny_model("llama", seed=0)
    prompt = [3, 5, 7, 9, 11, 13]
    ref = prompt + decode(Engine(model), make_method("ntp"), prompt, 24)[0]
    out, stats = decode(Context(Engine(model)), Twice(ref), prompt, 24)
    assert out == ref[len(prompt) :] and stats.drafted == 6
    drafts = [i for i, (kind, _) in enumerate(steps) if kind == "draft"]
    assert drafts[0] == 0 and len(drafts) == 2, steps
    assert steps[1] == ("plain", 0.0), steps  # the start: plain decoding's
    assert steps[drafts[1] + 1][0] == "plain" and steps[drafts[1] + 1][1] != 0.0, steps


def test_a_draft_steps_host_work_nets_the_pipelines_stop_against_its_restart(smollm):
    """Where a draft step breaks the pipeline, the plain step that stops it
    finds its queued pass mostly done and the one that restarts it waits for
    two passes (MLX on a CPU). The pair costs about two plain steps, so a
    draft step's measured host work (what it costs beyond the device time of
    its pass) counts the restart's excess against the stop's shortfall:
    a method with almost no host work of its own is measured well under half
    a plain step (the restart alone would be about one)."""
    from mlx_mtp.methods.base import DraftMethod
    from mlx_mtp.offers import chain_offer

    class EveryFourth(DraftMethod):
        """auto: the reference's next three tokens, four tokens after the
        last draft step (until one drafts them)."""

        name, auto = "every-fourth", True

        def __init__(self, ref):
            super().__init__()
            self.ref = ref

        def begin(self, ctx, prompt, sampler):
            self.seq, self.at = list(prompt), len(prompt) + 4

        def propose(self, ctx, root):
            n = len(self.seq)
            guess = self.ref[n : n + 3] if n >= self.at else []
            return chain_offer(root, guess, "oracle", ctx.acceptance, free=True)

        def observe(self, ctx, draft, result):
            self.seq += result.tokens
            if draft is not None:
                self.at = len(self.seq) + 4

    prompt = smollm.tokenizer.encode("Count from one to thirty in words: one, two,")
    ref = prompt + decode(Engine(smollm.model), make_method("ntp"), prompt, 60)[0]
    shares = []
    for _ in range(3):  # the median of three generations: one stall is the machine's
        ctx, method = Context(Engine(smollm.model)), EveryFourth(ref)
        out, stats = decode(ctx, method, prompt, 60)
        assert out == ref[len(prompt) :]
        learned = ctx.learned[method.settings_key()]
        times = learned.times
        assert stats.drafted > 0 and times.host is not None and times.plain
        shares.append(times.host / times.plain)
    assert sorted(shares)[1] < 0.35, shares


class Costly:
    """A draft method whose proposal takes ``cost`` seconds of device work
    beside the target's passes (as a draft model's passes do), offering the
    reference continuation (``right``) or wrong tokens."""

    def __new__(cls, ref, cost, right=True):
        from mlx_mtp.methods.base import DraftMethod
        from mlx_mtp.offers import chain_offer

        class _Costly(DraftMethod):
            name, auto = "costly", True

            def begin(self, ctx, prompt, sampler):
                self.seq, self.made = list(prompt), 0

            def propose(self, ctx, root):
                time.sleep(cost)  # its passes: host time on a simulated clock ...
                ctx.engine.clock.add_beside(cost)  # ... counted as device work
                self.made += 1
                n = len(self.seq)
                guess = ref[n : n + 4] if right else [(root + 7) % 256] * 4
                return chain_offer(root, guess, "oracle", ctx.acceptance)

            def observe(self, ctx, draft, result):
                self.seq += result.tokens

        return _Costly()


def test_a_draft_already_made_is_sent_where_it_pays_whatever_making_it_cost(simulate):
    """The device work an offer took (a draft model's passes) is spent
    whatever the step sends: the cut prices only what sending adds. Drafts
    that cost two forwards to make and are right are sent, and the
    generation is faster than plain decoding."""

    simulate(SPEC)
    model = make_tiny_model("llama", seed=0)
    prompt = [3, 5, 7, 9, 11, 13]
    ref = prompt + decode(Engine(model), make_method("ntp"), prompt, 40)[0]
    method = Costly(ref, cost=0.024)
    out, stats = decode(Context(Engine(model)), method, prompt, 40)
    assert out == ref[len(prompt) :]
    assert stats.accepted >= 0.5 * 40 and stats.steps < 0.5 * 40, stats


def test_declined_drafts_that_cost_device_work_count_as_drafting_loss(simulate, monkeypatch):
    """An offer whose drafts took device work and were then not sent lost
    that work: the ledger counts it, so a method whose costly drafts are
    never worth sending stops making them within the credit."""
    from mlx_mtp import planner

    ledgers = []
    real = planner.Planner.finish
    monkeypatch.setattr(planner.Planner, "finish", lambda p: ledgers.append(p) or real(p))
    simulate(SPEC)
    model = make_tiny_model("llama", seed=0)
    prompt = [3, 5, 7, 9, 11, 13]
    ref = prompt + decode(Engine(model), make_method("ntp"), prompt, 60)[0]
    ctx, method = Context(Engine(model)), Costly(ref, cost=0.024, right=False)
    ctx.learned.clear()
    out, stats = decode(ctx, method, prompt, 60)
    assert out == ref[len(prompt) :]
    p = ledgers[-1]
    assert p.ledger.loss > 0 and method.made <= 5, (p.ledger.loss, method.made)


def test_drafting_that_loses_a_generation_time_ends_in_plain_mode(monkeypatch, simulate):
    """Acceptance estimates carried over from a text the drafts copied (a
    first generation on the context, every draft right) meet a text where
    every draft is wrong: the planner measures each draft step, the restart
    after it and the queued pass finished before it against plain steps of
    the tokens they committed (``loss``), and drafting stops within
    ``EPSILON`` of the generation's time plus one plain step and one draft
    step."""
    from mlx_mtp import planner
    from mlx_mtp.methods.base import DraftMethod
    from mlx_mtp.offers import chain_offer

    class Oracle(DraftMethod):
        """Drafts the reference continuation (``right``) or wrong tokens."""

        name, auto = "oracle-chain", True

        def __init__(self, refs):
            super().__init__()
            self.refs, self.right = refs, True

        def begin(self, ctx, prompt, sampler):
            self.seq = list(prompt)
            self.ref = self.refs[tuple(prompt)]

        def propose(self, ctx, root):
            time.sleep(0.004)  # 4 ms of host work, as prompt lookup's here
            n = len(self.seq)
            guess = self.ref[n : n + 6] if self.right else [(root + 7) % 256] * 6
            return chain_offer(root, guess, "oracle", ctx.acceptance)

        def observe(self, ctx, draft, result):
            self.seq += result.tokens

    simulate(SPEC)
    monkeypatch.setenv("MLX_MTP_HOST_TERM", "1")
    model = make_tiny_model("llama", seed=0)
    first, second = [3, 5, 7, 9, 11, 13], [40, 2, 17, 90, 33, 8]
    refs = {}
    for p in (first, second):
        refs[tuple(p)] = p + decode(Engine(model), make_method("ntp"), p, 48)[0]

    ledgers = []
    real = planner.Planner.finish
    monkeypatch.setattr(planner.Planner, "finish", lambda p: ledgers.append(p) or real(p))

    def run():
        ctx, method = Context(Engine(model)), Oracle(refs)
        out, stats = decode(ctx, method, first, 48)
        assert out == refs[tuple(first)][len(first) :]
        assert stats.drafted > 0 and stats.accepted > 0.8 * stats.drafted
        method.right = False
        out, stats = decode(ctx, method, second, 48)
        assert out == refs[tuple(second)][len(second) :]
        return stats, ctx.learned[method.settings_key()]

    stats, learned = run()
    drafting = stats.steps - stats.plain_steps
    assert stats.accepted == 0 and drafting <= 5, (drafting, stats.drafted)
    p = ledgers[-1]
    # a draft step of six rejected tokens: c(7) and the host work measured
    worst = p.curve(7) + p.host_cost - p.plain_cost
    assert p.ledger.loss <= planner.EPSILON * p.ledger.time + p.plain_cost + worst


def test_a_wait_for_the_queued_pass_outside_the_steps_counts_in_the_next_step(smollm, monkeypatch):
    """An interleaved benchmark waits for the pass a pipelined plain step left
    queued after the step returns (``DeviceClock.outside``); the planner counts
    that wait in the next step's time, as a run alone would, instead of seeing
    plain steps cheaper than they are."""
    from mlx_mtp import costs
    from mlx_mtp.api import MTPModel

    seen: list[tuple[int, float]] = []
    real = costs.LiveCurves.observe

    def observe(self, slots, seconds, context):
        seen.append((slots, seconds))
        return real(self, slots, seconds, context)

    monkeypatch.setattr(costs.LiveCurves, "observe", observe)
    m = MTPModel(smollm, make_method("pld"))
    prompt = "Write a short poem about rain."
    ref = m.generate(prompt, max_tokens=12, temp=0.0).tokens
    it = m.stream_generate(prompt, max_tokens=12, temp=0.0)
    got = list(next(it).tokens) + list(next(it).tokens)  # the pipeline's start is not timed
    seen.clear()
    m.engine.clock.outside = 5.0  # the benchmark waited 5 s after the step
    got += next(it).tokens
    assert [s for n, s in seen if n == 1] and all(s >= 5.0 for n, s in seen if n == 1)
    seen.clear()
    got += next(it).tokens  # taken once
    assert all(s < 5.0 for _, s in seen)
    for chunk in it:
        got += chunk.tokens
    assert got == ref
    m.engine.clock.outside = 3.0  # left over after a generation: not the next one's
    seen.clear()
    m.generate(prompt, max_tokens=4, temp=0.0)
    assert all(s < 3.0 for _, s in seen)
