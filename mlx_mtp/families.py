"""Which mlx-lm model families each kind of method can run, and the checks at load.

A draft *tree* needs the cache-view forward pass (:mod:`mlx_mtp.cache_view`):
the attention asks the cache for its mask and RoPE offset, and the tree's
slots get their own positions and ancestor mask (sliding windows, attention
sinks, QK norms, soft-capping, NoPE layers, MLA and indexer caches, MoE
routing all work through that), input embeddings (mask vectors) go in through
the token embedding (:class:`Backbone`), and logits come out through the
model's own head (:class:`Head`). Families whose layers compute positions or
masks without asking the cache, or keep recurrent state, cannot run a tree;
:data:`NO_TREE` says why and what runs instead. The families table
(:func:`family_table`, ``mlx-mtp models --families``, docs/families.md) is
built from these definitions for every model type the installed mlx-lm ships.

These checks run once, when a method is bound to a model, and refuse with a
message that names the model type, the reason and what works.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .cache_view import install_positional_rope
from .errors import UnsupportedModelError
from .recurrent import ROLLBACK_FAMILIES, is_recurrent

#: what a family runs: draft trees and chains (every method), token chains
#: only (pld, mtp; on hybrid recurrent models also probe / hybrid shape=chain),
#: or plain decoding only (ntp)
TREE, CHAIN, PLAIN = "tree", "chain", "plain"

#: Model types whose tree forward pass is verified with a tiny random model
#: of the family's shapes and layer pattern (tests/test_families.py: the tree
#: forward equals the sequential forward, pld / probe / hybrid / lookahead
#: equal plain decoding); mlx-lm's aliases of them (``mistral`` runs as
#: ``llama``) are included through :func:`family_support`.
TREE_FAMILIES = frozenset(
    """
    Klear afmoe apertus bailing_moe bailing_moe_v3 cohere cohere2 dbrx deepseek deepseek_v2
    deepseek_v3 deepseek_v32 dots1 ernie4_5 ernie4_5_moe exaone exaone4 exaone_moe gemma gemma2
    gemma3 gemma3_text gemma4 gemma4_text glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa gpt_neox
    gpt_oss gptj granite granitemoe helium hunyuan hunyuan_v1_dense internlm2 internlm3
    iquestloopcoder kimi_k25 kimi_vl laguna lille-130m llama llama4_text longcat_flash mellum
    mimo mimo_v2_flash minicpm minicpm3 minimax minimax_m3_vl mixtral muse_glimmer nanbeige
    nemotron nemotron-nas olmo2 olmo3 olmoe openelm phi phi3 phimoe pixtral plamo plamo3 qwen
    qwen2 qwen2_moe qwen2_vl qwen3 qwen3_moe qwen3_vl qwen3_vl_moe seed_oss smollm3 solar_open
    spark2_5 stablelm starcoder2 step3p5 telechat3 youtu_llm
    """.split()
)

#: what the tree pass meets in some tree families (the others: plain causal
#: attention through the cache)
TREE_NOTES: dict[str, str] = {
    "gemma3_text": "five sliding-window layers per global one, QK norms",
    "gemma3": "Gemma 3 with its vision tower dropped: as gemma3_text",
    "gemma4_text": "four sliding-window layers per global one, KV-sharing layers",
    "gemma4": "Gemma 4 with its other towers dropped: as gemma4_text",
    "gemma2": "attention and final logit soft-capping",
    "cohere2": "three sliding-window layers per global one (NoPE global layers), logit scale",
    "exaone4": "sliding-window layers (LLLG pattern), QK norms",
    "exaone_moe": "sliding-window and global layers, MoE",
    "gpt_oss": "attention sinks, alternating sliding-window layers, MoE",
    "mimo_v2_flash": "sliding-window layers with attention sinks, MoE",
    "afmoe": "sliding-window and global layers, MoE",
    "olmo3": "sliding-window and global layers, QK norms",
    "mellum": "sliding-window and global layers with their own RoPE, MoE",
    "spark2_5": "sliding-window and global layers, gated attention",
    "step3p5": "sliding-window layers, head-wise attention gates, MoE",
    "iquestloopcoder": "loop layers over a sliding-window cache",
    "plamo3": "sliding-window layers",
    "muse_glimmer": "sliding-window layers",
    "smollm3": "NoPE layers (every fourth)",
    "llama4_text": "NoPE layers (every fourth), attention temperature tuning, MoE",
    "deepseek_v3": "multi-head latent attention (MLA) cache, MoE routing",
    "deepseek_v2": "multi-head latent attention (MLA) cache, MoE routing",
    "deepseek_v32": "MLA with a sparse-attention indexer cache (CacheList)",
    "glm_moe_dsa": "MLA with a sparse-attention indexer cache (CacheList)",
    "longcat_flash": "MLA (CacheList per layer), zero-computation experts",
    "minimax_m3_vl": "two caches per layer (CacheList)",
    "kimi_k25": "DeepSeek-V3 text model (MLA)",
    "kimi_vl": "DeepSeek-V3 text model (MLA)",
    "minicpm3": "MLA, scaled embeddings and residuals",
    "youtu_llm": "MLA",
    "glm4_moe_lite": "MLA, MoE",
    "qwen3_moe": "QK norms, MoE routing",
    "olmo2": "QK norms after the projections",
    "phi3": "fused QKV, partial / long-context RoPE",
    "glm4": "partial RoPE, extra norms",
    "granite": "embedding, attention, residual and logit multipliers",
    "granitemoe": "multipliers, MoE",
    "cohere": "parallel blocks, logit scale",
}

_RECURRENT = (
    "layers keep recurrent or convolution state (mlx-lm's ArraysCache) that no trim can "
    "take back to before a rejected draft, and mlx_mtp.recurrent rolls back only "
    "gated delta-net mixers ({})".format(", ".join(ROLLBACK_FAMILIES))
)

#: Model types that cannot run a draft tree: (what they run, why)
NO_TREE: dict[str, tuple[str, str]] = {
    **{
        t: (
            CHAIN,
            "gated delta-net layers read tokens in sequence: a branching tree cannot run "
            "through them; chains are rolled back by replaying the accepted tokens "
            "(mlx_mtp.recurrent)",
        )
        for t in ROLLBACK_FAMILIES
    },
    **{
        t: (PLAIN, _RECURRENT)
        for t in """
        baichuan_m1 bailing_hybrid bailing_moe_linear falcon_h1 gear granitemoehybrid jamba
        kimi_k3 kimi_linear lfm2 lfm2-vl lfm2_moe mamba mamba2 nemotron_h olmo_hybrid plamo2
        recurrent_gemma rwkv7
        """.split()
    },
    "prism_hadamard_qwen35": (
        PLAIN,
        "a 2-bit Hadamard-rotated pack of qwen3_5 (recurrent gated delta-net layers); "
        "state rollback is not tested on its packed layers",
    ),
    "deepseek_v41": (
        PLAIN,
        "its layer cache (a sliding window with compressed key blocks and an indexer) "
        "cannot drop tokens",
    ),
    "olmo": (
        PLAIN,
        "mlx-lm's olmo model needs the ai2-olmo package (not installed with mlx-lm); not tested",
    ),
    "afm7": (
        CHAIN,
        "its KV-reuse layers place RoPE by the key count (offset = keys - queries), not by "
        "the cache's positions",
    ),
    "gpt2": (
        CHAIN,
        "learned absolute position embeddings are looked up as one range from cache.offset",
    ),
    "gpt_bigcode": (
        CHAIN,
        "learned absolute position embeddings are looked up as one range from cache.offset",
    ),
    "llama4": (
        CHAIN,
        "its chunked-attention layers build their mask from cache.offset as a range, not "
        "through the cache",
    ),
    "ministral3": (
        CHAIN,
        "its Llama-4 attention scaling reads an array cache.offset as one offset per "
        "sequence of a batch",
    ),
    "mistral3": (
        CHAIN,
        "its text model (ministral3) reads an array cache.offset as one offset per sequence "
        "of a batch (Llama-4 attention scaling)",
    ),
    "mistral4": (
        CHAIN,
        "its Llama-4 attention scaling reads an array cache.offset as one offset per "
        "sequence of a batch",
    ),
    "nanochat": (
        CHAIN,
        "it applies RoPE with mx.fast.rope on cache.offset itself (no RoPE module to give "
        "each slot its position)",
    ),
    "talkie": (
        CHAIN,
        "it applies RoPE with mx.fast.rope on cache.offset itself (no RoPE module to give "
        "each slot its position)",
    ),
    "phi3small": (
        CHAIN,
        "its block-sparse attention layers build their mask from the key and query counts, "
        "not through the cache (chains not verified here: mlx-lm's phi3small aborts in "
        "one-token decoding on MLX's CPU backend)",
    ),
    "phixtral": (
        CHAIN,
        "its decoder takes the mask from the causal LM's call and wraps the token embedding, "
        "so mask vectors cannot be fed",
    ),
    "gemma3n": (
        CHAIN,
        "its text model computes the logits inside the decoder (AltUp / per-layer inputs), "
        "so there are no hidden states to feed mask vectors or read mask rows from",
    ),
    "longcat_flash_ngram": (
        PLAIN,
        "its n-gram embeddings keep the last token ids in a cache (ArraysCache) that cannot "
        "drop rejected tokens, and hash them in input order, which a tree's branches do not "
        "follow",
    ),
    "bitnet": (
        CHAIN,
        "not verified: its BitLinear kernels need the Metal backend, which the test machine "
        "lacks; tree methods stay refused until its tiny model runs",
    ),
    "muse_spark": (
        CHAIN,
        "not verified: its fused QK-norm RoPE kernel needs the Metal backend, which the test "
        "machine lacks; tree methods stay refused until its tiny model runs",
    ),
}

#: what runs, per kind, for the messages and the table
RUNS = {
    TREE: "every method",
    CHAIN: "pld, mtp (token chains) and ntp",
    PLAIN: "ntp",
}


def _target(model_type: str) -> str:
    """The mlx-lm module a model type runs as (``mistral`` -> ``llama``)."""
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


def family_support(model_type: str) -> tuple[str, str]:
    """(``tree`` | ``chain`` | ``plain``, the reason) for an mlx-lm model type
    (an alias is looked up as the module it runs as)."""
    target = _target(model_type)
    alias = "" if target == model_type else f"runs as {target}: "
    if model_type in TREE_FAMILIES or target in TREE_FAMILIES:
        note = TREE_NOTES.get(model_type) or TREE_NOTES.get(target)
        return TREE, alias + (f"{note}; " if note else "") + "tree pass verified on a tiny model"
    for t in (model_type, target):
        if t in NO_TREE:
            kind, why = NO_TREE[t]
            return kind, alias + why
    return PLAIN, alias + "not in this version's families table (untested)"


def what_runs(model_type: str) -> str:
    """The methods a model type runs, as the refusals name them."""
    kind, _ = family_support(model_type)
    if model_type in ROLLBACK_FAMILIES or _target(model_type) in ROLLBACK_FAMILIES:
        return "pld, mtp, probe shape=chain, hybrid shape=chain and ntp"
    return RUNS[kind]


def mlx_lm_model_types() -> list[str]:
    """Every model type the installed mlx-lm ships: each module of
    ``mlx_lm.models`` with a ``Model`` and ``ModelArgs`` (found without
    importing them) and each alias of ``MODEL_REMAPPING``."""
    import ast
    import pkgutil
    from pathlib import Path

    import mlx_lm.models
    from mlx_lm.utils import MODEL_REMAPPING

    found = set()
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        path = Path(mlx_lm.models.__path__[0]) / f"{info.name}.py"
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        names = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        if {"Model", "ModelArgs"} <= names:
            found.add(info.name)
    found |= {k for k, v in MODEL_REMAPPING.items() if v in found}
    return sorted(found, key=str.lower)


def family_table() -> list[tuple[str, str, str]]:
    """(model type, ``tree`` | ``chain`` | ``plain``, reason) for every model
    type of the installed mlx-lm (:func:`mlx_lm_model_types`)."""
    return [(t, *family_support(t)) for t in mlx_lm_model_types()]


def families_markdown() -> str:
    """The families table as Markdown (docs/families.md is this text)."""
    import mlx_lm

    rows = family_table()
    count = {k: sum(r[1] == k for r in rows) for k in (TREE, CHAIN, PLAIN)}
    lines = [
        "# Model families",
        "",
        f"Every model type of mlx-lm {mlx_lm.__version__} and what mlx-mtp runs on it "
        f"({count[TREE]} tree, {count[CHAIN]} chain, {count[PLAIN]} plain only). Generated "
        "from `mlx_mtp/families.py` (`mlx-mtp models --families --markdown`).",
        "",
        f"- **tree**: {RUNS[TREE]} (draft trees: probe, hybrid, lookahead, clp; chains: pld, mtp).",
        f"- **chain**: {RUNS[CHAIN]}; on the hybrid recurrent models with state rollback "
        "also probe / hybrid `shape=chain`.",
        f"- **plain**: {RUNS[PLAIN]} only.",
        "",
        "| model type | runs | why |",
        "|---|---|---|",
    ]
    lines += [f"| `{t}` | {k} | {why} |" for t, k, why in rows]
    return "\n".join(lines) + "\n"


#: names under which mlx-lm backbones keep their token embedding, most common first
EMBEDDING_NAMES = (
    "embed_tokens",
    "wte",
    "word_embeddings",
    "tok_embeddings",
    "token_embeddings",
    "embed_in",
    "embedding",
    "embeddings",
    "embed",
)
#: names under which mlx-lm causal LMs keep their backbone (the decoder stack)
BACKBONE_NAMES = ("model", "transformer", "backbone")


def _owner(model: nn.Module) -> tuple[nn.Module, str]:
    """(the text causal LM, the key of its backbone): a vision-language wrapper
    keeps the text model under ``language_model``."""
    owner = model["language_model"] if "language_model" in model else model
    for key in BACKBONE_NAMES:
        if key in owner and isinstance(owner[key], nn.Module):
            return owner, key
    raise UnsupportedModelError(
        f"model type {getattr(model, 'model_type', type(model).__name__)!r} keeps its decoder "
        f"under none of {', '.join(BACKBONE_NAMES)}; multi-token methods need it. Use --method "
        "ntp for this model."
    )


def _embedding_key(inner: nn.Module, mtype: str) -> str:
    for key in EMBEDDING_NAMES:
        if key in inner and hasattr(inner[key], "as_linear"):
            return key
    raise UnsupportedModelError(
        f"model type {mtype!r} has no token embedding under {', '.join(EMBEDDING_NAMES)}; "
        "multi-token methods need one. Use --method ntp for this model."
    )


class _Returns:
    """Stands in for a backbone while the causal LM's own ``__call__`` turns
    given hidden states into logits: returns them, whatever it is called with;
    other attributes (a tied embedding's ``as_linear``) are the backbone's."""

    def __init__(self, inner: nn.Module, h: mx.array):
        self._inner, self._h = inner, h

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._h

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Feeds(_Returns):
    """Stands in for a token embedding: returns the given input embeddings."""


class Head:
    """The LM head of an mlx-lm causal LM as a function of the backbone's
    output: ``head(h)`` for h (L, D) or (B, L, D) gives logits (L, V) or
    (B, L, V), exactly as the model's ``__call__`` computes them after its
    backbone (tied or untied projection, logit soft-capping, logit scales),
    since it *is* that ``__call__`` with the backbone standing aside."""

    def __init__(self, owner: nn.Module, key: str):
        self.owner, self.key = owner, key

    def __call__(self, h: mx.array) -> mx.array:
        flat = h.ndim == 2
        h3 = h[None] if flat else h
        inner = self.owner[self.key]
        self.owner[self.key] = _Returns(inner, h3)
        try:
            out = self.owner(mx.zeros(h3.shape[:2], dtype=mx.int32))
        finally:
            self.owner[self.key] = inner
        return out[0] if flat else out


class Backbone:
    """The decoder stack of an mlx-lm causal LM: ``backbone(inputs, cache,
    input_embeddings)`` gives the final-norm hidden states (B, L, D).

    ``input_embeddings`` (B, L, D) replace the token embeddings (mask vectors
    of a draft tree): the embedding module returns them for this call, so the
    backbone treats them exactly as the embeddings of token ids (whatever
    scale it applies after the lookup; a backbone's own ``input_embeddings``
    argument skips that scale in some families). ``inputs``, if given, still
    go to the backbone: some families read the token ids for more than the
    embedding (per-layer embeddings)."""

    def __init__(self, inner: nn.Module, embed_key: str):
        self.inner, self.embed_key = inner, embed_key

    def __call__(
        self,
        inputs: mx.array | None,
        cache: Any = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        if input_embeddings is None:
            return self.inner(inputs, cache=cache)
        if inputs is None:
            inputs = mx.zeros(input_embeddings.shape[:2], dtype=mx.int32)
        emb = self.inner[self.embed_key]
        self.inner[self.embed_key] = _Feeds(emb, input_embeddings)
        try:
            return self.inner(inputs, cache=cache)
        finally:
            self.inner[self.embed_key] = emb


def model_parts(model: nn.Module) -> tuple[Backbone, Head, nn.Module]:
    """Split an mlx-lm causal LM into (backbone, lm_head, embed_tokens).

    ``backbone(inputs, cache, input_embeddings)`` returns the final-norm hidden
    states (B, L, D); ``lm_head(h)`` maps them to logits (B, L, V) or (L, V)
    exactly as the model does (:class:`Head`); ``embed_tokens(ids)`` is the
    token embedding (before any scale the backbone applies).

    Raises:
        UnsupportedModelError: the model keeps no backbone or token embedding
            under the names mlx-lm uses.
    """
    mtype = getattr(model, "model_type", type(model).__name__)
    owner, key = _owner(model)
    inner = owner[key]
    ekey = _embedding_key(inner, mtype)
    return Backbone(inner, ekey), Head(owner, key), inner[ekey]


def check_tree_support(model: nn.Module, method: str) -> None:
    """Refuse a model whose architecture cannot run a tree forward pass (see
    :func:`family_support`); install per-token RoPE where it can.

    Raises:
        UnsupportedModelError: naming the model type, the reason and the
            methods that run on it.
    """
    mtype = getattr(model, "model_type", type(model).__name__)
    kind, why = family_support(mtype)
    if kind != TREE:
        raise UnsupportedModelError(
            f"--method {method} cannot run model type {mtype!r}: a draft tree needs every "
            f"attention layer to take its positions and mask from the cache, and {why}. "
            f"On this model use {what_runs(mtype)}."
        )
    model_parts(model)  # raises with the reason when the layout is not found
    install_positional_rope(model)


def check_cache_support(engine: Any, method: Any) -> None:
    """Refuse, at load, a method that drops tokens from the KV cache (rejected
    drafts, mask slots) on a model whose cache cannot: recurrent or hybrid
    layers (mamba, gated delta-net, short convolutions) keep state that no trim
    can roll back (docs/design.md, failure class 3). ``engine`` is an
    :class:`~mlx_mtp.engine.Engine` (its cache and rollback are read; this
    module sits below the engine, which imports it).

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
            f"{len(engine.cache)} layers keep state ({kinds}) that cannot drop rejected "
            "draft tokens"
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
