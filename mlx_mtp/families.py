"""Which mlx-lm model families each kind of method can run, and the checks at load.

A draft *tree* needs the cache-view forward pass (:mod:`mlx_mtp.cache_view`):
per-token RoPE positions and a tree mask, input embeddings for mask vectors.
A method that drops rejected drafts needs caches that can drop them
(recurrent layers cannot, except for chain passes rolled back by
:mod:`mlx_mtp.recurrent`). These checks run once, when a method is bound to a
model, and refuse with a message that names the model type and what works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.nn as nn
from mlx_lm.utils import does_model_support_input_embeddings

from .cache_view import install_positional_rope
from .errors import UnsupportedModelError
from .recurrent import is_recurrent

if TYPE_CHECKING:
    from .engine import Engine

#: Model families whose tree forward pass is tested (docs/design.md §4): the one list of
#: the families multi-token methods and MTP checkpoints support
TREE_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}


def model_parts(model: nn.Module) -> tuple[nn.Module, Any, nn.Module]:
    """Split an mlx-lm causal LM into (backbone, lm_head, embed_tokens).

    ``backbone(inputs, cache, input_embeddings)`` returns the final-norm hidden
    states (B, L, D); ``lm_head(h)`` maps them to logits (B, L, V).

    Raises:
        UnsupportedModelError: the model does not have the llama-style layout
            (``model.model.embed_tokens``, tied embeddings or ``lm_head``).
    """
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if inner is None or embed is None:
        raise UnsupportedModelError(
            f"model type {getattr(model, 'model_type', type(model).__name__)!r} does not have "
            "the llama-style layout (model.embed_tokens) that multi-token methods need."
        )
    # a vision-language wrapper (qwen3_5) keeps the text model and its LM head
    # under language_model
    owner = model["language_model"] if "language_model" in model else model
    args = getattr(owner, "args", None)
    if getattr(args, "tie_word_embeddings", False) or not hasattr(owner, "lm_head"):
        head = embed.as_linear
    else:
        head = owner.lm_head
    return inner, head, embed


def check_tree_support(model: nn.Module, method: str) -> None:
    """Refuse a model whose architecture cannot run a tree forward pass.

    Raises:
        UnsupportedModelError: naming the model type and the reason.
    """
    mtype = getattr(model, "model_type", type(model).__name__)
    if mtype not in TREE_FAMILIES:
        raise UnsupportedModelError(
            f"--method {method} cannot run model type {mtype!r}: its draft-tree forward pass "
            f"is supported for {', '.join(sorted(TREE_FAMILIES))}. Use --method ntp for this "
            "model."
        )
    if not does_model_support_input_embeddings(model):
        raise UnsupportedModelError(
            f"--method {method}: model type {mtype!r} does not accept input embeddings."
        )
    try:
        install_positional_rope(model)
    except AttributeError as e:
        raise UnsupportedModelError(
            f"--method {method}: model type {mtype!r} has layers without self_attn.rope ({e})."
        ) from e


def check_cache_support(engine: Engine, method: Any) -> None:
    """Refuse, at load, a method that drops tokens from the KV cache (rejected
    drafts, mask slots) on a model whose cache cannot: recurrent or hybrid
    layers (mamba, gated delta-net, short convolutions) keep state that no trim
    can roll back (docs/design.md, failure class 3).

    Raises:
        UnsupportedModelError: naming the model type and its cache kinds.
    """
    if not getattr(method, "needs_trimmable_cache", True):
        return
    chain = getattr(method, "chain_shaped", False) and engine.rollback is not None
    fixed = [
        c
        for c in engine.cache
        if not (hasattr(c, "is_trimmable") and c.is_trimmable()) and not (chain and is_recurrent(c))
    ]
    if fixed:
        mtype = getattr(engine.model, "model_type", type(engine.model).__name__)
        kinds = ", ".join(sorted({type(c).__name__ for c in fixed}))
        raise UnsupportedModelError(
            f"--method {method.name} cannot run model type {mtype!r}: {len(fixed)} of its "
            f"{len(engine.cache)} layers keep recurrent state ({kinds}) that cannot drop "
            "rejected draft tokens"
            + (
                "; only chain-drafting methods (mtp, pld, probe shape=chain, hybrid "
                "shape=chain) can roll it back, a branching draft tree cannot run through a "
                "recurrent layer"
                if engine.rollback is not None
                else ""
            )
            + (
                ". Use --method ntp, mtp, pld, hybrid or probe shape=chain for this model."
                if engine.rollback is not None
                else ". Use --method ntp for this model."
            )
        )
