"""Training learned mask embeddings (the model stays frozen).

Goal: one hidden-size vector per mask slot such that, placed after an anchor
token t (slot j at RoPE position t + 1 + j, seeing the tokens up to t and the
earlier slots of its own set, exactly as in a ``probe`` forward pass), the
slot's logits predict the token at t + 2 + j of the model's *own* greedy
continuation. Loss: cross-entropy of the slot logits against those tokens.

Sample efficiency: the keys and values of a whole sequence are computed once
(no gradient, the model is frozen); one training forward then carries mask sets
after many anchors at once, each set attending only to its own prefix through a
tree mask with per-token positions (the same attention pattern as
:meth:`mlx_mtp.engine.Engine.forward_tree`). Only the mask slots go through the
layers, so a step costs about ``anchors * slots`` tokens.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from tqdm import tqdm

from ..cache_view import FixedCache, install_positional_rope
from ..errors import InvalidArgumentError
from ..families import model_parts
from ..verify import top_tokens
from .continuations import TrainSequence


# ------------------------------------------------------------ tree forward
def prefix_kv(model: nn.Module, tokens: list[int]) -> list[tuple[mx.array, mx.array]]:
    """Per-layer (keys, values) of a causal forward over ``tokens`` (evaluated)."""
    backbone, _, _ = model_parts(model)
    cache = make_prompt_cache(model)
    backbone(mx.array(tokens)[None], cache=cache)
    n = len(tokens)
    kv = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]
    mx.eval(kv)
    return kv


def mask_set_layout(anchors: np.ndarray, slots: int, prefix_len: int) -> tuple[np.ndarray, ...]:
    """Attention mask and positions for ``slots`` chained mask slots after each anchor.

    Args:
        anchors: (A,) anchor positions t (each < prefix_len).
        slots: mask slots per anchor (k).
        prefix_len: T, tokens whose keys/values precede the mask slots.

    Returns:
        mask (A*k, T + A*k) bool: slot j of anchor t sees tokens 0..t and slots
        0..j of its own set; positions (A*k,) int32: t + 1 + j.
    """
    a = len(anchors)
    m = a * slots
    mask = np.zeros((m, prefix_len + m), dtype=bool)
    pos = np.zeros(m, dtype=np.int32)
    for i, t in enumerate(anchors):
        for j in range(slots):
            r = i * slots + j
            mask[r, : t + 1] = True
            mask[r, prefix_len + i * slots : prefix_len + r + 1] = True
            pos[r] = t + 1 + j
    return mask, pos


def mask_logits(
    model: nn.Module,
    kv: list[tuple[mx.array, mx.array]],
    anchors: np.ndarray,
    vectors: mx.array,
) -> mx.array:
    """Logits (A*k, V) of mask slots ``vectors`` (k, D) attached after each anchor.

    Row ``i*k + j`` is slot j after ``anchors[i]`` and predicts the token at
    ``anchors[i] + 2 + j``. Differentiable in ``vectors``.
    """
    install_positional_rope(model)  # idempotent: per-token RoPE positions
    backbone, head, _ = model_parts(model)
    k = vectors.shape[0]
    prefix_len = kv[0][0].shape[2]
    mask, pos = mask_set_layout(anchors, k, prefix_len)
    mask_mx, pos_mx = mx.array(mask), mx.array(pos)
    views = [FixedCache(mask_mx, pos_mx, prefix) for prefix in kv]
    emb = mx.tile(vectors, (len(anchors), 1)).astype(kv[0][0].dtype)
    h = backbone(None, cache=views, input_embeddings=emb[None])[0]
    return head(h)


def anchor_targets(tokens: Sequence[int], anchors: np.ndarray, slots: int) -> np.ndarray:
    """(A*k,) targets: row i*k + j is ``tokens[anchors[i] + 2 + j]``."""
    toks = np.asarray(tokens)
    return np.stack([toks[anchors + 2 + j] for j in range(slots)], axis=1).reshape(-1)


def valid_anchors(seq: TrainSequence, slots: int) -> np.ndarray:
    """Anchor positions whose targets lie in the generated part: from the last
    prompt token (the first decoding root) to ``len - 2 - slots``."""
    T = len(seq.tokens)
    lo = len(seq.prompt) - 1
    hi = T - 2 - slots  # inclusive: target anchors + 1 + slots <= T - 1
    return np.arange(lo, hi + 1) if hi >= lo else np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------- training
@dataclass
class TrainResult:
    """Learned vectors (slots, D) and the loss history."""

    vectors: mx.array
    train_loss: list[float] = field(default_factory=list)
    val_loss_before: float = math.nan
    val_loss_after: float = math.nan


def mean_prompt_vectors(model: nn.Module, seqs: Sequence[TrainSequence], slots: int) -> mx.array:
    """(slots, D): the mean prompt embedding over ``seqs`` (the paper's init)."""
    _, _, embed = model_parts(model)
    means = [mx.mean(embed(mx.array(s.prompt)).astype(mx.float32), axis=0) for s in seqs]
    m = mx.mean(mx.stack(means), axis=0)
    return mx.broadcast_to(m, (slots, m.shape[0]))


def eval_masks(
    model: nn.Module,
    seqs: Sequence[TrainSequence],
    vectors_for: Any,
    slots: int,
    topk: int = 5,
) -> dict[str, float]:
    """Mean loss and top-1 / top-k hit rates of each slot over every valid anchor.

    Args:
        vectors_for: (k, D) array used for every sequence, or a callable
            ``seq -> (k, D)`` (e.g. the sequence's own mean prompt embedding).

    Returns:
        ``{"loss": .., "top1_t+2": .., "top5_t+2": .., "top1_t+3": .., ...}``
        (hit rates as fractions, t+2 = slot 1).
    """
    tot_loss, n = 0.0, 0
    hits1 = np.zeros(slots)
    hitsk = np.zeros(slots)
    rows = 0
    for s in seqs:
        anchors = valid_anchors(s, slots)
        if len(anchors) == 0:
            continue
        vec = vectors_for(s) if callable(vectors_for) else vectors_for
        kv = prefix_kv(model, s.tokens)
        logits = mask_logits(model, kv, anchors, vec).astype(mx.float32)
        tgt = mx.array(anchor_targets(s.tokens, anchors, slots))
        loss = nn.losses.cross_entropy(logits, tgt, reduction="sum")
        top = top_tokens(logits, topk)
        best = mx.argmax(logits, axis=-1)
        tot_loss += float(loss)
        n += int(tgt.size)
        t_np = np.array(tgt).reshape(-1, slots)
        hits1 += (np.array(best).reshape(-1, slots) == t_np).sum(0)
        top_np = np.array(top).reshape(-1, slots, topk)
        hitsk += (top_np == t_np[..., None]).any(-1).sum(0)
        rows += len(anchors)
    out = {"loss": tot_loss / max(n, 1), "anchors": rows}
    for j in range(slots):
        out[f"top1_t+{j + 2}"] = hits1[j] / max(rows, 1)
        out[f"top{topk}_t+{j + 2}"] = hitsk[j] / max(rows, 1)
    return out


def train_masks(
    model: nn.Module,
    train: Sequence[TrainSequence],
    slots: int = 2,
    steps: int = 200,
    lr: float = 3e-3,
    anchors_per_step: int = 48,
    seed: int = 0,
    init: mx.array | None = None,
    progress: bool = True,
    kv_cache_gb: float = 4.0,
) -> TrainResult:
    """Learn ``slots`` mask vectors by Adam on the cross-entropy of their logits.

    Each step draws one training sequence and up to ``anchors_per_step`` random
    anchors in its generated part, and runs one tree forward with a mask set
    after every anchor. The model is frozen (only the vectors get gradients).

    Args:
        init: (slots, D) starting vectors; default the mean prompt embedding.
        kv_cache_gb: bound (GiB) on the prefix keys/values kept between steps
            (least recently used sequences are recomputed when drawn again).

    Raises:
        InvalidArgumentError: no sequence long enough to train on.
    """
    install_positional_rope(model)
    model.freeze()
    usable = [s for s in train if len(valid_anchors(s, slots)) > 0]
    if not usable:
        raise InvalidArgumentError(
            "no training sequence has enough generated tokens; use more prompts or --max-tokens"
        )
    rng = random.Random(seed)
    vec = mx.array(init if init is not None else mean_prompt_vectors(model, usable, slots))
    vec = vec.astype(mx.float32)
    params = {"masks": vec}
    opt = optim.Adam(learning_rate=lr)
    opt.init(params)
    # prefix keys/values per sequence, least recently used dropped past the bound
    kv_cache: OrderedDict[int, list[tuple[mx.array, mx.array]]] = OrderedDict()
    kv_bytes = 0

    def loss_fn(p, kv, anchors, tgt):
        logits = mask_logits(model, kv, anchors, p["masks"]).astype(mx.float32)
        return nn.losses.cross_entropy(logits, tgt, reduction="mean")

    grad_fn = mx.value_and_grad(loss_fn)
    result = TrainResult(vectors=vec)
    bar = tqdm(range(steps), desc="train masks", disable=not progress)
    for _ in bar:
        i = rng.randrange(len(usable))
        s = usable[i]
        if i in kv_cache:
            kv_cache.move_to_end(i)
        else:
            kv_cache[i] = prefix_kv(model, s.tokens)
            kv_bytes += sum(k.nbytes + v.nbytes for k, v in kv_cache[i])
            while kv_bytes > kv_cache_gb * 2**30 and len(kv_cache) > 1:
                _, old = kv_cache.popitem(last=False)
                kv_bytes -= sum(k.nbytes + v.nbytes for k, v in old)
        anchors = valid_anchors(s, slots)
        if len(anchors) > anchors_per_step:
            anchors = np.sort(np.array(rng.sample(list(anchors), anchors_per_step)))
        tgt = mx.array(anchor_targets(s.tokens, anchors, slots))
        loss, grads = grad_fn(params, kv_cache[i], anchors, tgt)
        opt.update(params, grads)
        mx.eval(params, opt.state, loss)
        result.train_loss.append(float(loss))
        recent = result.train_loss[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
    result.vectors = params["masks"]
    return result
