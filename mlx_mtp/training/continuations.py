"""The model's own greedy continuations of training prompts, for every trainer.

All three trainers learn from self-distilled targets: the frozen model's
greedy continuation of each prompt (``train masks`` learns mask vectors
predicting it, ``train clp`` heads predicting it from the hidden states of the
same decode, ``train mtp`` a student matching its teacher on it). This module
generates them once, batched, and keeps them in a file so that a rerun or a
resumed run does not decode them again:

- :func:`greedy_continuations`: left-padded batched greedy decoding (mlx-lm
  ``BatchKVCache``, or ``ArraysCache`` for recurrent layers), optionally with
  the final-norm hidden state of every step.
- :class:`Continuations`: continuations of a fixed prompt list, generated in
  batches on demand (all at once or a few indices at a time) and appended to
  a jsonl file (:func:`save_continuations` / :func:`read_continuations`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache
from tqdm import tqdm

from ..artifacts import atomic_write, atomic_write_text
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..families import model_parts


@dataclass
class TrainSequence:
    """A prompt and the model's greedy continuation of it.

    Attributes:
        prompt: prompt token ids.
        generated: greedy tokens, ending with the EOS token if one was produced.
        hidden: (len(generated), D) float16, row i the final-norm hidden state
            whose argmax is ``generated[i]``; None unless asked for.
    """

    prompt: list[int]
    generated: list[int]
    hidden: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


def _batch_cache(model: nn.Module, left_padding: list[int]) -> list[Any]:
    """One left-padded batch cache per layer (attention: ``BatchKVCache``,
    recurrent: ``ArraysCache`` with the padding masked).

    Raises:
        UnsupportedModelError: a layer cache of another kind (e.g. rotating).
    """
    out: list[Any] = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            out.append(BatchKVCache(left_padding))
        elif type(c) is ArraysCache:
            out.append(ArraysCache(len(c.cache), left_padding=left_padding))
        else:
            raise UnsupportedModelError(
                f"batched greedy decoding does not support {type(c).__name__} layers; "
                "train on a model with plain KV caches"
            )
    return out


def greedy_continuations(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos: set[int],
    batch_size: int = 16,
    hidden: bool = False,
    progress: bool | tqdm = True,
) -> list[TrainSequence]:
    """Greedy continuations of token-id ``prompts``, decoded in batches.

    Prompts are sorted by length, then decoded ``batch_size`` at a time,
    left-padded (a batch of one is decoded as two copies: a (1,) offset array
    would mean per-token positions to :class:`~mlx_mtp.cache_view.PositionalRoPE`).
    Batched float32 greedy output equals one-by-one greedy decoding except
    where two logits nearly tie (checked on SmolLM2 in the tests); for training
    targets that does not matter.

    Args:
        max_tokens: new tokens per prompt (fewer after an EOS, which is kept).
        eos: end-of-sequence ids (:func:`mlx_mtp.confadapt_format.tokenizer_eos_ids`).
        hidden: also return each step's final-norm hidden state (float16).
        progress: show a tqdm bar, or a bar to update (one tick per prompt).

    Returns:
        One :class:`TrainSequence` per prompt, in the order given.

    Raises:
        UnsupportedModelError: a layer cache that cannot be batched.
    """
    backbone, lm_head, _ = model_parts(model)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    bar = progress if isinstance(progress, tqdm) else None
    if bar is None:
        bar = tqdm(total=len(prompts), desc="greedy continuations", disable=not progress)
    done: dict[int, TrainSequence] = {}
    for b0 in range(0, len(order), batch_size):
        idx = order[b0 : b0 + batch_size]
        rows = [list(prompts[i]) for i in idx]
        rows = rows if len(rows) > 1 else rows * 2
        width = max(len(p) for p in rows)
        pad = [width - len(p) for p in rows]
        x = mx.array([[0] * n + p for n, p in zip(pad, rows)], dtype=mx.int32)
        cache = _batch_cache(model, pad)
        h = backbone(x, cache=cache)[:, -1:]
        toks, hids = [], []
        finished = np.zeros(len(rows), dtype=bool)
        for _ in range(max_tokens):
            y = mx.argmax(lm_head(h), axis=-1)  # (B, 1)
            mx.eval(y, h)
            yn = np.array(y)[:, 0]
            toks.append(yn)
            if hidden:
                hids.append(np.array(h[:, 0].astype(mx.float16)))
            finished |= np.isin(yn, list(eos))
            if finished.all():
                break
            h = backbone(y, cache=cache)
        T = np.stack(toks, axis=1)
        Hs = np.stack(hids, axis=1) if hidden else None
        for r, i in enumerate(idx):
            gen = T[r].tolist()
            cut = next((j for j, t in enumerate(gen) if t in eos), None)
            gen = gen if cut is None else gen[: cut + 1]
            H = Hs[r, : len(gen)] if Hs is not None else None
            done[i] = TrainSequence(list(prompts[i]), gen, H)
        bar.update(len(idx))
    if not isinstance(progress, tqdm):
        bar.close()
    return [done[i] for i in range(len(prompts))]


# ------------------------------------------------------------------ the file
def _hidden_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.hidden-*.npz"))


def save_continuations(path: str | Path, seqs: Sequence[TrainSequence], meta: dict) -> None:
    """Write ``seqs`` (as indices 0..n-1) to a new jsonl file, atomically:
    first line ``{"meta": ...}``, then one ``{"i", "prompt", "generated"}``
    line each (hidden states, where present, in ``PATH.hidden-*.npz``).
    Replaces what was there."""
    path = Path(path)
    for f in _hidden_files(path):
        f.unlink()
    atomic_write_text(path, json.dumps({"meta": meta}) + "\n")
    append_continuations(path, dict(enumerate(seqs)))


def append_continuations(path: str | Path, items: dict[int, TrainSequence]) -> None:
    """Add ``items`` (prompt index -> sequence) to a file made by
    :func:`save_continuations`: hidden states first (a new npz, written
    atomically), then the lines in one write, so an interrupted run leaves
    at most a cut last line (skipped on reading)."""
    path = Path(path)
    if not items:
        return
    with_hidden = {i: s.hidden for i, s in items.items() if s.hidden is not None}
    if with_hidden:
        dest = path.with_name(f"{path.name}.hidden-{min(with_hidden):09d}.npz")
        atomic_write(dest, lambda t: np.savez(t, **{str(i): h for i, h in with_hidden.items()}))
    lines = "".join(
        json.dumps({"i": i, "prompt": s.prompt, "generated": s.generated}) + "\n"
        for i, s in items.items()
    )
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":  # a line cut by an interruption: drop it
                f.seek(0)
                f.truncate(f.read().rfind(b"\n") + 1)
        f.seek(0, os.SEEK_END)
        f.write(lines.encode())


def read_continuations(path: str | Path, meta: dict) -> dict[int, TrainSequence] | None:
    """The sequences in ``path`` (prompt index -> sequence) if its ``meta``
    equals ``meta``; None if there is no such file or it was written for other
    settings. A last line cut by an interruption is skipped.

    Raises:
        InvalidArgumentError: the file exists but is not a continuations file.
    """
    path = Path(path)
    if not path.is_file():
        return None
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        lines = lines[:-1]  # cut by an interruption
    try:
        records = [json.loads(line) for line in lines if line.strip()]
        if not records or "meta" not in records[0]:
            raise ValueError("no meta line first")
        if records[0]["meta"] != meta:
            return None
        out = {
            int(r.get("i", n)): TrainSequence(list(r["prompt"]), list(r["generated"]))
            for n, r in enumerate(records[1:])
        }
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise InvalidArgumentError(
            f"continuations file {path}: not one written by mlx-mtp ({e}); "
            "delete it or pass another path"
        ) from e
    for f in _hidden_files(path):
        with np.load(f) as z:
            for key in z.files:
                if int(key) in out:
                    out[int(key)].hidden = z[key]
    return out


def load_continuations(path: str | Path, meta: dict) -> list[TrainSequence] | None:
    """All sequences of a file written by :func:`save_continuations`, in index
    order; None if absent, written for other settings, or incomplete.

    Raises:
        InvalidArgumentError: the file exists but is not a continuations file.
    """
    got = read_continuations(path, meta)
    if got is None or sorted(got) != list(range(len(got))):
        return None
    return [got[i] for i in range(len(got))]


class Continuations:
    """Greedy continuations of a fixed list of token-id prompts, generated in
    batches when first asked for and kept in ``path`` (if given).

    The file is reused when its meta matches: ``meta`` plus ``max_tokens``,
    ``hidden`` and a SHA-256 of the prompts; otherwise it is started anew.

    Args:
        model: the frozen model whose greedy decoding gives the targets.
        prompts: token ids per prompt.
        max_tokens, eos, batch_size, hidden: as in :func:`greedy_continuations`.
        path: jsonl file to keep them in (None: memory only).
        meta: what else the continuations depend on (model fingerprint, dtype).
        progress: show a tqdm bar in :meth:`all`.
        own_file: ``path`` is the caller's own working file (a trainer's
            checkpoint folder), so one it cannot read (e.g. written by an
            older version) is started anew instead of refused.

    Raises:
        InvalidArgumentError: ``path`` exists but is not a continuations file
            (and ``own_file`` is False).
    """

    def __init__(
        self,
        model: nn.Module,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        eos: set[int],
        *,
        batch_size: int = 16,
        hidden: bool = False,
        path: str | Path | None = None,
        meta: dict | None = None,
        progress: bool = True,
        own_file: bool = False,
    ):
        self.model, self.prompts, self.max_tokens = model, [list(p) for p in prompts], max_tokens
        self.eos, self.batch_size, self.hidden, self.progress = eos, batch_size, hidden, progress
        self.path = Path(path) if path is not None else None
        digest = hashlib.sha256(json.dumps(self.prompts).encode()).hexdigest()
        self.meta = {
            **(meta or {}),
            "max_tokens": max_tokens,
            "hidden": hidden,
            "prompts_sha256": digest,
        }
        self.done: dict[int, TrainSequence] = {}
        if self.path is not None:
            try:
                got = read_continuations(self.path, self.meta)
            except InvalidArgumentError:
                if not own_file:
                    raise
                got = None
            if got is None:
                save_continuations(self.path, [], self.meta)
            else:
                # hidden states lost with an interrupted npz write: decode again
                self.done = {i: s for i, s in got.items() if not hidden or s.hidden is not None}

    def get(self, indices: Sequence[int], bar: tqdm | None = None) -> list[TrainSequence]:
        """The continuations of prompts ``indices`` (missing ones decoded together)."""
        todo = [i for i in dict.fromkeys(indices) if i not in self.done]
        if todo:
            seqs = greedy_continuations(
                self.model,
                [self.prompts[i] for i in todo],
                self.max_tokens,
                self.eos,
                self.batch_size,
                self.hidden,
                bar if bar is not None else False,
            )
            new = dict(zip(todo, seqs))
            if self.path is not None:
                append_continuations(self.path, new)
            self.done.update(new)
        return [self.done[i] for i in indices]

    def all(self, budget_s: float | None = None) -> list[TrainSequence]:
        """Every prompt's continuation, decoded ``batch_size`` at a time in
        order of prompt length (less padding; saved after every batch, so an
        interrupted run resumes). With ``budget_s`` no batch starts after
        that many seconds: the continuations made by then, in prompt order
        (the shortest prompts first generated)."""
        n = len(self.prompts)
        t0 = time.monotonic()
        with tqdm(
            total=n,
            initial=len(self.done),
            desc="greedy continuations",
            unit="prompt",
            disable=not self.progress,
        ) as bar:
            todo = sorted(
                (i for i in range(n) if i not in self.done), key=lambda i: len(self.prompts[i])
            )
            for b0 in range(0, len(todo), self.batch_size):
                if budget_s is not None and time.monotonic() - t0 >= budget_s:
                    break
                self.get(todo[b0 : b0 + self.batch_size], bar)
        return [self.done[i] for i in range(n) if i in self.done]
