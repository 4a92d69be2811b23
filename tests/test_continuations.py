"""The trainers' shared greedy continuations (mlx_mtp.training.continuations):
batching, hidden states, the file they are kept in, resuming."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import make_tiny_model

from mlx_mtp.errors import InvalidArgumentError
from mlx_mtp.families import model_parts
from mlx_mtp.training.continuations import (
    Continuations,
    TrainSequence,
    greedy_continuations,
    read_continuations,
)

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [4, 4, 4, 10, 11], [20]]


@pytest.fixture(scope="module")
def model():
    m = make_tiny_model("qwen3", seed=2)
    m.model.embed_tokens.weight = m.model.embed_tokens.weight * 0.03  # varied tokens
    return m


def _one_by_one(model, prompt, n, eos):
    """Plain greedy decoding of one prompt, one token per forward."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1]
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits, axis=-1).item())
        out.append(t)
        if t in eos:
            break
        logits = model(mx.array([[t]]), cache=cache)[:, -1]
    return out


def test_batched_equals_one_by_one_with_eos_and_hidden(model):
    ref = [_one_by_one(model, p, 10, set()) for p in PROMPTS]
    j = next(j for j in range(2, 10) if ref[-1][j] not in ref[-1][:j])
    eos = {ref[-1][j]}  # ends the last prompt's continuation early (EOS kept)
    ref = [_one_by_one(model, p, 10, eos) for p in PROMPTS]
    assert len(ref[-1]) == j + 1 and len({len(r) for r in ref}) > 1
    for batch in (1, 3, 8):
        seqs = greedy_continuations(model, PROMPTS, 10, eos, batch, hidden=True, progress=False)
        assert [s.prompt for s in seqs] == PROMPTS
        assert [s.generated for s in seqs] == ref, batch
    backbone, _, _ = model_parts(model)
    for s in seqs:  # hidden row i: the final-norm state whose argmax is generated[i]
        assert s.hidden.shape == (len(s.generated), 64) and s.hidden.dtype == np.float16
        h = backbone(mx.array(s.tokens[:-1])[None])[0, len(s.prompt) - 1 :]
        assert np.allclose(s.hidden, np.array(h), atol=2e-2, rtol=1e-2)


def test_file_resumes_and_restarts_on_other_settings(model, tmp_path, monkeypatch):
    import mlx_mtp.training.continuations as tc

    path = tmp_path / "c.jsonl"
    calls = []
    real = tc.greedy_continuations

    def counting(m, prompts, *a, **k):
        calls.append(len(prompts))
        return real(m, prompts, *a, **k)

    monkeypatch.setattr(tc, "greedy_continuations", counting)
    kw = dict(batch_size=2, hidden=True, path=path, meta={"model": "tiny"}, progress=False)
    c = Continuations(model, PROMPTS, 6, set(), **kw)
    first = c.get([2])  # one prompt decoded, appended to the file
    assert calls == [1] and read_continuations(path, c.meta).keys() == {2}
    everything = c.all()
    assert calls == [1, 2, 1] and everything[2] == first[0]
    # a new run reads them all back (hidden states included): no decoding
    again = Continuations(model, PROMPTS, 6, set(), **kw)
    assert again.all() == everything and calls == [1, 2, 1]
    for a, b in zip(again.all(), everything):
        assert np.array_equal(a.hidden, b.hidden)
    # a line cut by an interruption is decoded again, the rest is kept
    path.write_text(path.read_text()[:-7])
    assert len(Continuations(model, PROMPTS, 6, set(), **kw).all()) == 4 and calls[-1] == 1
    # other settings (max_tokens) start the file anew
    other = Continuations(model, PROMPTS, 3, set(), **kw).all()
    assert [len(s.generated) for s in other] == [3] * 4
    assert read_continuations(path, c.meta) is None


def test_not_a_continuations_file(model, tmp_path):
    path = tmp_path / "c.jsonl"
    for text in ("hello\n", '{"prompt": "a prompts file, not continuations"}\n'):
        path.write_text(text)
        with pytest.raises(InvalidArgumentError, match="continuations file"):
            Continuations(model, PROMPTS, 4, set(), path=path)
        assert path.read_text() == text  # left as it was
    # a trainer's own file in an older format is decoded again instead
    path.write_text('{"prompt": 0, "tokens": [5, 6]}\n')
    c = Continuations(model, PROMPTS, 4, set(), path=path, own_file=True, progress=False)
    assert len(c.all()) == 4 and read_continuations(path, c.meta).keys() == {0, 1, 2, 3}
    assert TrainSequence([1], [2]).tokens == [1, 2]
