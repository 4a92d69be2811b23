"""The thread contract of the Python API (docs/design.md, "Threads"): threads
sharing one loaded model, each with its own binding, get the answers each
gets alone; two threads on one binding get a one-line ModelBusyError, never
a mixed cache. SmolLM2-135M float32."""

from __future__ import annotations

import threading

import pytest

from mlx_mtp.errors import ModelBusyError, WrongThreadError
from mlx_mtp.threads import model_lock

PROMPTS = [
    "Repeat after me: one two three, one two three, one two three.",
    "Name three colours.",
    "What is 7 times 8?",
    "Tell me a story about a cat.",
]
METHODS = [("ntp", {}), ("pld", {}), ("probe", {"bc": 10}), ("hybrid", {})]


def _run_threads(targets: list) -> list:
    """Run each callable in a thread of its own, all released at once;
    return what each returned or raised."""
    start = threading.Barrier(len(targets))
    out: list = [None] * len(targets)

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = targets[i]()
        except BaseException as e:  # noqa: BLE001 (reported to the test)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    return out


def test_four_threads_with_their_own_bindings_answer_as_alone(smollm):
    bound = [smollm.bind(m, **opts) for m, opts in METHODS]
    alone = [m.generate(p, max_tokens=24).tokens for m, p in zip(bound, PROMPTS)]
    # fresh bindings (empty caches) and the solo ones again (their caches reused)
    for models in ([smollm.bind(m, **opts) for m, opts in METHODS], bound):
        got = _run_threads(
            [lambda m=m, p=p: m.generate(p, max_tokens=24).tokens for m, p in zip(models, PROMPTS)]
        )
        assert got == alone


def test_two_threads_streaming_on_their_bindings_take_turns(smollm):
    """Streams left open between steps block no other thread (no lock is
    held across a yield)."""
    a, b = smollm.bind("probe", bc=10), smollm.bind("pld")
    alone = [a.generate(PROMPTS[3], max_tokens=16).tokens, b.generate(PROMPTS[0], max_tokens=16)]
    alone[1] = alone[1].tokens
    stream = a.stream_generate(PROMPTS[3], max_tokens=16)
    first = list(next(stream).tokens)  # suspended, holding a's cache
    (other,) = _run_threads([lambda: b.generate(PROMPTS[0], max_tokens=16).tokens])
    for chunk in stream:
        first.extend(chunk.tokens)
    assert [first, other] == alone


def test_two_threads_on_one_binding_one_is_refused(smollm):
    m = smollm.bind("pld")
    want = m.generate(PROMPTS[0], max_tokens=16).tokens
    # one holds the binding (a stream started in this thread), the other is refused
    stream = m.stream_generate(PROMPTS[0], max_tokens=16)
    got = list(next(stream).tokens)
    (err,) = _run_threads([lambda: m.generate(PROMPTS[1], max_tokens=4)])
    assert isinstance(err, ModelBusyError)
    assert "already generating" in str(err) and "\n" not in str(err)
    for chunk in stream:
        got.extend(chunk.tokens)
    assert got == want
    # four at once on one binding: each runs alone or is refused (one at a time
    # holds it; a thread that comes after it finished runs in its turn)
    out = _run_threads([lambda: m.generate(PROMPTS[0], max_tokens=16).tokens] * 4)
    assert want in out
    assert all(o == want or isinstance(o, ModelBusyError) for o in out)


def test_every_engine_over_a_model_shares_its_lock(smollm):
    a, b = smollm.bind("ntp"), smollm.bind("pld")
    assert a.engine.turn is b.engine.turn is model_lock(smollm.model)


@pytest.mark.parametrize("method", ["ntp", "probe"])
def test_generation_takes_the_model_lock_per_step(smollm, method):
    """While another thread holds the model's lock, a generation waits at its
    next step; between steps it holds none."""
    m = smollm.bind(method)
    lock = model_lock(smollm.model)
    started, go, stepped = threading.Event(), threading.Event(), threading.Event()

    def generate() -> None:
        stream = m.stream_generate(PROMPTS[1], max_tokens=6)
        next(stream)
        started.set()
        go.wait(timeout=60)
        next(stream)
        stepped.set()
        stream.close()

    s = threading.Thread(target=generate)
    s.start()
    assert started.wait(timeout=120)
    with lock:  # taken between two steps: the stream held none
        go.set()
        assert not stepped.wait(timeout=0.5)  # its next step waits for the lock
    s.join(timeout=120)
    assert stepped.is_set()


def test_a_stream_read_on_another_thread_is_refused(smollm):
    m = smollm.bind("probe", bc=10)
    want = m.generate(PROMPTS[1], max_tokens=8).tokens
    stream = m.stream_generate(PROMPTS[1], max_tokens=8)
    next(stream)
    (err,) = _run_threads([lambda: next(stream)])
    assert isinstance(err, WrongThreadError)
    assert "thread that started it" in str(err) and "\n" not in str(err)
    # the binding is free again and answers as before, on this thread or another
    assert m.generate(PROMPTS[1], max_tokens=8).tokens == want
    assert _run_threads([lambda: m.generate(PROMPTS[1], max_tokens=8).tokens]) == [want]
