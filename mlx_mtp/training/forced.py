"""Teacher-forced self-distillation targets over a text corpus.

The cheapest targets for MTP heads on a CPU: one prefill per window of corpus
text gives, at every position n, the frozen backbone's final-norm hidden state
``h_n`` and its greedy prediction ``a_n = argmax lm_head(h_n)`` (the token the
backbone would emit after ``x_0..x_n``). A CLP head j then learns to predict
``a_{n+j}`` from ``(h_n, e(x_{n+1}))`` (:mod:`mlx_mtp.training.clp`). One
prefill of T tokens costs about as much as T decode steps' arithmetic but runs
as large matmuls, and yields T positions where greedy continuation yields one.

- :func:`corpus_documents`: documents from JSONL records. A record with
  ``question`` and ``answer`` (GSM8K) becomes a user/assistant chat (the
  calculator annotations ``<<...>>`` removed), ``messages`` a chat, ``text``
  plain text, and a prompt only (``turns``, ``prompt``, ...) a rendered user
  prompt.
- :func:`pack_windows`: the tokenized documents concatenated (EOS between
  them) and cut into windows of T tokens.
- :class:`ForcedTargets`: the windows' tokens, hidden states (float16) and
  greedy predictions, computed in shards of a few windows and kept as
  ``forced-NNNNN.npz`` files in a folder, so that a stopped run resumes at the
  first shard it had not written.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from ..artifacts import atomic_write, atomic_write_text
from ..data import _jsonl, prompt_text, render_prompt
from ..errors import InvalidArgumentError
from ..families import model_parts
from ..fingerprint import model_fingerprint

_CALC = re.compile(r"<<[^>]*>>")


def document_text(tokenizer: Any, record: Any) -> str | None:
    """The text one JSONL record contributes to a corpus (see module docstring);
    None when it has none."""
    if isinstance(record, dict):
        q, a = record.get("question"), record.get("answer")
        if isinstance(q, str) and isinstance(a, str):
            msgs = [
                {"role": "user", "content": q.strip()},
                {"role": "assistant", "content": _CALC.sub("", a).strip()},
            ]
            return _chat(tokenizer, msgs)
        if isinstance(record.get("messages"), list):
            return _chat(tokenizer, record["messages"])
        if isinstance(record.get("text"), str) and record["text"].strip():
            return record["text"]
    prompt = prompt_text(record)
    if not prompt:
        return None
    ids = render_prompt(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer.decode(ids)


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def corpus_documents(
    tokenizer: Any, paths: Iterable[str | Path], exclude: Iterable[str] = ()
) -> list[str]:
    """Documents of one or more JSONL files, in file order.

    Args:
        tokenizer: the model's tokenizer (chat records use its template).
        paths: JSONL files (records as in :func:`document_text`).
        exclude: user prompts whose records are left out (evaluation prompts).

    Raises:
        InvalidArgumentError: a missing file, a line that is not JSON, a record
            with no text, or no document at all.
    """
    skip = {t.strip() for t in exclude}
    docs: list[str] = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            raise InvalidArgumentError(f"--corpus {p}: no such file (expected JSONL)")
        for i, rec in _jsonl(path, InvalidArgumentError):
            if skip and prompt_text(rec) in skip:
                continue
            text = document_text(tokenizer, rec)
            if not text:
                raise InvalidArgumentError(
                    f"{path}:{i} has no text: use 'text', 'question' and 'answer', "
                    "'messages', or a prompt field"
                )
            docs.append(text)
    if not docs:
        raise InvalidArgumentError("the corpus has no documents")
    return docs


def pack_windows(
    tokenizer: Any, docs: list[str], window: int, limit: int | None = None
) -> np.ndarray:
    """Tokenize ``docs``, join them with EOS and cut the stream into windows.

    Returns:
        (W, window) int32; the tail shorter than a window is dropped. At most
        ``limit`` windows.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    stream: list[int] = []
    want = None if limit is None else limit * window
    for d in docs:
        stream.extend(tokenizer.encode(d, add_special_tokens=False))
        if eos is not None:
            stream.append(int(eos))
        if want is not None and len(stream) >= want:
            break
    n = len(stream) // window
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise InvalidArgumentError(f"the corpus has fewer than {window} tokens")
    return np.array(stream[: n * window], dtype=np.int32).reshape(n, window)


#: how many of the backbone's highest-scoring tokens each position keeps (the
#: hard negatives of the heads' sampled softmax)
TOP = 8


def top_tokens(logits: mx.array) -> mx.array:
    """The :data:`TOP` highest-scoring tokens of each row of ``logits``
    (..., V), unordered: (..., TOP) int32."""
    return mx.argpartition(-logits, TOP - 1, axis=-1)[..., :TOP].astype(mx.int32)


def forced_batch(model: nn.Module, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One prefill of a batch of windows.

    Args:
        tokens: (B, T) int32.

    Returns:
        ``hidden`` (B, T, D) float16 final-norm hidden states, ``argmax``
        (B, T) int32 greedy predictions (row n: the token after position n),
        ``top`` (B, T, TOP) int32 the highest-scoring tokens, unordered.
    """
    backbone, lm_head, _ = model_parts(model)
    h = backbone(mx.array(tokens))
    mx.eval(h)
    preds, tops = [], []
    for b in range(h.shape[0]):
        logits = lm_head(h[b : b + 1])
        preds.append(mx.argmax(logits, axis=-1))
        tops.append(top_tokens(logits))
        mx.eval(preds[-1], tops[-1])
    a = mx.concatenate(preds, axis=0).astype(mx.int32)
    top = mx.concatenate(tops, axis=0)
    return np.array(h.astype(mx.float16)), np.array(a), np.array(top)


class ForcedTargets:
    """Teacher-forced targets of fixed windows, computed shard by shard and
    kept in ``folder`` (``forced-NNNNN.npz`` and ``forced.json``).

    A folder whose ``forced.json`` names another model fingerprint or other
    windows (SHA-256 of the tokens) is started anew; otherwise the shards
    already written are kept and :meth:`compute` continues after them.

    Args:
        model: the frozen backbone (float32 recommended).
        windows: (W, T) int32 token windows (:func:`pack_windows`).
        folder: where the shards go.
        shard: windows per prefill batch and per file.
    """

    def __init__(self, model: nn.Module, windows: np.ndarray, folder: str | Path, shard: int = 4):
        self.model, self.windows, self.shard = model, windows, shard
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.meta = {
            "model_fingerprint": model_fingerprint(model),
            "windows": hashlib.sha256(windows.tobytes()).hexdigest(),
            "shape": list(windows.shape),
            "shard": shard,
        }
        meta_file = self.folder / "forced.json"
        old = json.loads(meta_file.read_text()) if meta_file.is_file() else None
        if old != self.meta:
            for f in self.folder.glob("forced-*.npz"):
                f.unlink()
            atomic_write_text(meta_file, json.dumps(self.meta))

    @property
    def n_shards(self) -> int:
        return -(-len(self.windows) // self.shard)

    def _file(self, i: int) -> Path:
        return self.folder / f"forced-{i:05d}.npz"

    def done(self) -> list[int]:
        """Indices of the shards already written."""
        return [i for i in range(self.n_shards) if self._file(i).is_file()]

    def compute(
        self, budget_s: float | None = None, desc: str = "targets", reverse: bool = False
    ) -> int:
        """Write the missing shards (a progress bar in tokens); stop after
        ``budget_s`` seconds. Returns the number of shards written in all.
        ``reverse`` goes from the last shard down, so that a second process
        on another core can share the work."""
        todo = [i for i in range(self.n_shards) if not self._file(i).is_file()]
        if reverse:
            todo.reverse()
        T = self.windows.shape[1]
        bar = tqdm(
            total=self.n_shards * self.shard * T,
            initial=(self.n_shards - len(todo)) * self.shard * T,
            desc=desc,
            unit="tok",
            unit_scale=True,
        )
        t0 = time.time()
        for i in todo:
            if budget_s is not None and time.time() - t0 > budget_s:
                break
            if self._file(i).is_file():  # written by another process meanwhile
                continue
            toks = self.windows[i * self.shard : (i + 1) * self.shard]
            hidden, argmax, top = forced_batch(self.model, toks)
            atomic_write(
                self._file(i),
                lambda t, toks=toks, hidden=hidden, argmax=argmax, top=top: np.savez(
                    t, tokens=toks, hidden=hidden, argmax=argmax, top=top
                ),
            )
            bar.update(toks.size)
        bar.close()
        return len(self.done())

    def load(self) -> dict[str, np.ndarray]:
        """The written shards, concatenated: ``tokens`` (W, T) int32,
        ``hidden`` (W, T, D) float16, ``argmax`` (W, T) int32, ``top``
        (W, T, TOP) int32.

        Raises:
            InvalidArgumentError: no shard written yet.
        """
        return load_shards(self.folder)


def load_shards(folder: str | Path) -> dict[str, np.ndarray]:
    """The shards of a :class:`ForcedTargets` folder, concatenated (see
    :meth:`ForcedTargets.load`).

    Raises:
        InvalidArgumentError: no shard in ``folder``.
    """
    files = sorted(Path(folder).glob("forced-*.npz"))
    if not files:
        raise InvalidArgumentError(f"no teacher-forced targets in {folder}")
    parts: dict[str, list[np.ndarray]] = {"tokens": [], "hidden": [], "argmax": [], "top": []}
    for f in files:
        with np.load(f) as z:
            for key, acc in parts.items():
                acc.append(z[key])
    return {key: np.concatenate(acc) for key, acc in parts.items()}


def forced_examples(shards: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """Training examples of CLP heads from teacher-forced windows.

    Position n of a window gives input ``(h_n, x_{n+1})`` and, for head j
    (1..k), target token ``a_{n+j}`` (the backbone's prediction after
    ``x_{n+1}..x_{n+j}``) and target state ``h_{n+j}``; positions whose
    targets fall outside the window are dropped.

    Returns:
        ``H`` (N, D) float16, ``nxt`` (N,) int64, ``tgt`` (N, k) int64,
        ``tgt_row`` (N, k) int64 rows of ``H_all`` (the flattened hidden
        states, also returned as ``H_all`` (W*T, D)), ``consistent`` (N, k)
        bool: the window's tokens n+1..n+j are the backbone's own greedy
        tokens (the inputs a head sees at decode time), ``top`` (W*T, TOP)
        the backbone's highest-scoring tokens at every flat position.
    """
    tokens, hidden, argmax = shards["tokens"], shards["hidden"], shards["argmax"]
    W, T = tokens.shape
    n = np.arange(T - k)
    rows = (np.arange(W)[:, None] * T + n[None, :]).reshape(-1)  # flat position n
    H_all = hidden.reshape(W * T, -1)
    flat_x, flat_a = tokens.reshape(-1).astype(np.int64), argmax.reshape(-1).astype(np.int64)
    tgt_row = rows[:, None] + np.arange(1, k + 1)[None, :]
    # x_{n+i} == a_{n+i-1}: the token at n+i is the backbone's own prediction
    own = flat_x[rows[:, None] + np.arange(1, k + 1)] == flat_a[rows[:, None] + np.arange(k)]
    return {
        "H": H_all[rows],
        "H_all": H_all,
        "nxt": flat_x[rows + 1],
        "tgt": flat_a[tgt_row],
        "tgt_row": tgt_row,
        "consistent": np.cumprod(own, axis=1).astype(bool),
        "top": shards["top"].reshape(W * T, -1),
    }


def continuation_windows(seqs: Iterable[Any], model: nn.Module, T: int) -> dict[str, np.ndarray]:
    """Greedy continuations as teacher-forced windows of ``T`` tokens, so that
    :func:`forced_examples` reads them like corpus windows.

    A continuation with hidden states (:class:`~mlx_mtp.training.continuations.TrainSequence`)
    is a window whose every token is the backbone's own: row t holds input
    token ``x_t`` (the prompt's last token, then the generated ones), the
    state ``h_t`` after it and the prediction ``a_t`` (the next generated
    token). Continuations shorter than ``T`` (an early EOS) are left out.

    Returns:
        The keys of :func:`load_shards`: ``tokens`` (W, T) int32, ``hidden``
        (W, T, D) float16, ``argmax`` (W, T) int32, ``top`` (W, T, TOP) int32.

    Raises:
        InvalidArgumentError: no continuation of ``T`` tokens with hidden states.
    """
    keep = [s for s in seqs if s.hidden is not None and len(s.generated) >= T]
    if not keep:
        raise InvalidArgumentError(
            f"no greedy continuation reached {T} tokens; lower --max-new-tokens or add prompts"
        )
    tokens = np.array([[s.prompt[-1]] + s.generated[: T - 1] for s in keep], dtype=np.int32)
    hidden = np.stack([s.hidden[:T] for s in keep]).astype(np.float16)
    argmax = np.array([s.generated[:T] for s in keep], dtype=np.int32)
    _, lm_head, _ = model_parts(model)
    top = []
    for i in range(0, len(keep), 16):
        top.append(np.array(top_tokens(lm_head(mx.array(hidden[i : i + 16]).astype(mx.float32)))))
    return {"tokens": tokens, "hidden": hidden, "argmax": argmax, "top": np.concatenate(top)}


def merge_examples(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """:func:`forced_examples` of several sources as one set (``tgt_row``
    offset into the concatenated ``H_all`` and ``top``)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, np.ndarray] = {}
    offsets = np.cumsum([0] + [len(p["H_all"]) for p in parts[:-1]])
    for key in parts[0]:
        out[key] = np.concatenate(
            [p[key] + off if key == "tgt_row" else p[key] for p, off in zip(parts, offsets)]
        )
    return out


def corpus_windows(
    tokenizer: Any,
    paths: Iterable[str | Path],
    window: int,
    limit: int | None = None,
    seed: int = 0,
    exclude: Iterable[str] = (),
) -> np.ndarray:
    """The windows of a corpus: its documents (:func:`corpus_documents`)
    shuffled with ``seed`` (so that any prefix of the windows mixes every
    file), packed by :func:`pack_windows`. (W, window) int32."""
    docs = corpus_documents(tokenizer, paths, exclude)
    order = np.random.default_rng(seed).permutation(len(docs))
    return pack_windows(tokenizer, [docs[i] for i in order], window, limit)
