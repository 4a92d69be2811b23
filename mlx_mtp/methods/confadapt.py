"""``confadapt``: decoding of self-distilled multi-token-prediction checkpoints.

Kirchenbauer, Hans, Bartoldson, Goldblum, Panda, Goldstein, *Multi-Token
Prediction via Self-Distillation* (arXiv 2602.06019; DESIGN §2.3). Read top to
bottom:

1. The model is an ordinary causal LM whose vocabulary has one extra mask token
   ``<|mtp_special_token_0|>`` (its id is looked up in the tokenizer, or in the
   metadata of an on-device adapter; never hard-coded).
2. One forward pass carries the tokens committed since the last pass (the
   "pending" ones, not yet in the KV cache), the root (the last committed
   token) and k-1 mask tokens, at contiguous positions under the plain causal
   mask. The root and the k-1 masks give k next-token distributions: the root
   predicts the next token, mask i the token i positions further on.
3. ConfAdapt(tau): keep the leading tokens whose top-1 probability is >= tau,
   always at least one; static-k keeps all k. The block ends at its first EOS.
4. The masks' KV is dropped. The emitted tokens are fed again at the next step,
   so each step processes n + k - 1 tokens (n = tokens emitted last step).

Lossy by design: the mask predictions are not verified. "Eff. k" (tokens per
forward pass) is the acceleration the paper reports; the decoding loop's tau is
exactly that number.

Cache contract (differs from lossless methods, see :class:`ConfAdapt`): after
:meth:`ConfAdapt.step` the cache holds the committed tokens up to and including
this step's root; the tokens emitted by the step are not cached yet (the last
one is the loop's next root, the others are re-fed by the method). The cache
never holds anything that was not committed, so the loop's final trim and the
next chat turn's prefix reuse (:meth:`Engine.sync`) stay correct.

Where the mask token comes from, in order (see :func:`find_mtp_source`):
an explicit ``adapter=DIR`` option; ``mtp_config.json`` in the model folder
(written by ``mlx-mtp convert mtp-checkpoint``); the mask token in the
tokenizer (a checkpoint loaded straight from its hub folder); an on-device
adapter for this base model (``mlx-mtp train mtp``, found by the model
fingerprint in the cache folder or among the adapters shipped with mlx-mtp).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tuner.lora import LoRALinear

from ..dims import model_dims, packed_width_factor
from ..engine import Engine, model_parts
from ..errors import CheckpointMismatchError, InvalidArgumentError, UnsupportedModelError
from ..sampling import draw
from ..verify import Sampler
from .base import Method, StepOutput, parse_int

#: the mask token string of the released checkpoints (Qwen3-4B id 151669, Llama-3.1-8B 128259)
MASK_TOKEN = "<|mtp_special_token_0|>"
#: metadata file in a converted or adapted model folder
MTP_CONFIG = "mtp_config.json"
#: metadata file of an on-device LoRA adapter folder
ADAPTER_CONFIG = "mtp_adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
#: prompt formats: "plain" = BOS + input + "\n\n" (the Qwen checkpoint), "chat" = chat template
PROMPT_FORMATS = ("plain", "chat")
#: adapters shipped with the package (one sub-folder each)
SHIPPED_ADAPTERS = Path(__file__).resolve().parent.parent / "assets" / "confadapt"


class MissingMaskTokenError(UnsupportedModelError):
    """A model with no MTP mask token and no adapter for it."""


# --------------------------------------------------------------------- metadata
@dataclass
class MTPMetadata:
    """What decoding needs to know about a self-distilled MTP model.

    Attributes:
        mask_token_id: id of ``<|mtp_special_token_0|>`` (input only; its
            logit is never emitted).
        eos_token_ids: ids that end generation.
        prompt_format: ``"plain"`` (BOS + input + "\\n\\n") or ``"chat"``.
        k: default block size (tokens per forward pass at most).
        mask_token: the mask token string.
        source: where the weights came from (repo id, folder or base model).
    """

    mask_token_id: int
    eos_token_ids: list[int] = field(default_factory=list)
    prompt_format: str = "chat"
    k: int = 16
    mask_token: str = MASK_TOKEN
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"format": "mlx-mtp-confadapt", "version": 1, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "") -> MTPMetadata:
        """Parse the JSON dict of :data:`MTP_CONFIG`.

        Raises:
            CheckpointMismatchError: a missing or malformed field.
        """
        try:
            meta = cls(
                mask_token_id=int(d["mask_token_id"]),
                eos_token_ids=[int(x) for x in d.get("eos_token_ids", [])],
                prompt_format=str(d.get("prompt_format", "chat")),
                k=int(d.get("k", 16)),
                mask_token=str(d.get("mask_token", MASK_TOKEN)),
                source=str(d.get("source", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointMismatchError(
                f"{where or 'MTP metadata'} is malformed ({type(e).__name__}: {e}); "
                "convert the checkpoint again with `mlx-mtp convert mtp-checkpoint`."
            ) from e
        if meta.prompt_format not in PROMPT_FORMATS:
            raise CheckpointMismatchError(
                f"{where}: unknown prompt_format {meta.prompt_format!r} (use plain or chat)."
            )
        return meta


def read_metadata(folder: Path) -> MTPMetadata | None:
    """The :data:`MTP_CONFIG` of a model folder, or None if it has none."""
    f = Path(folder) / MTP_CONFIG
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointMismatchError(f"{f} is not valid JSON ({e}).") from e
    return MTPMetadata.from_json(d, str(f))


def write_metadata(folder: Path, meta: MTPMetadata) -> None:
    """Write :data:`MTP_CONFIG` into ``folder``."""
    (Path(folder) / MTP_CONFIG).write_text(json.dumps(meta.to_json(), indent=2) + "\n")


def tokenizer_mask_id(tokenizer: Any) -> int | None:
    """Id of :data:`MASK_TOKEN` in a tokenizer (HF or mlx-lm wrapper), None if absent."""
    tok = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        vocab = tok.get_vocab()
    except Exception:  # a tokenizer without get_vocab: ask it to convert
        vocab = {}
    if MASK_TOKEN in vocab:
        return int(vocab[MASK_TOKEN])
    return None


def tokenizer_eos_ids(tokenizer: Any) -> list[int]:
    """EOS ids of an mlx-lm tokenizer wrapper (or HF tokenizer)."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        eid = getattr(tokenizer, "eos_token_id", None)
        ids = [] if eid is None else [eid]
    return sorted(int(i) for i in ids)


# ------------------------------------------------------------ model surgery
class MaskGate:
    """The mask-token positions of the forward pass being run, shared by a
    :class:`MaskedEmbedding` (which sets it from the input ids) and the
    :class:`GatedLoRALinear` layers of the same model (which read it).

    Attributes:
        value: (B, L, 1) float32, 1.0 at mask-token positions, else 0.0; None
            before the first forward pass.
    """

    def __init__(self) -> None:
        self.value: mx.array | None = None


class GatedLoRALinear(LoRALinear):
    """A LoRA linear (mlx-lm's :class:`~mlx_lm.tuner.lora.LoRALinear`) whose
    low-rank delta applies only at mask-token positions.

    ``y = W x + gate * scale * (x A) B`` with gate 1 at mask tokens and 0 at
    every real token, so real tokens (their hidden states, KV and next-token
    logits) are computed by the unchanged base model and only the mask slots
    see the adapter. This is the gated LoRA of Samragh et al., *Your LLM Knows
    the Future* (arXiv 2507.11851, §3.3): MTP adaptation that cannot change
    next-token prediction. Not fusable into the base weight.

    Args (of :meth:`from_base`):
        linear: the base ``nn.Linear`` / ``nn.QuantizedLinear`` (not copied).
        gate: the model's :class:`MaskGate`.
        r, scale: LoRA rank and scale.
    """

    @classmethod
    def from_base(  # type: ignore[override]
        cls, linear: nn.Module, gate: MaskGate, r: int = 8, scale: float = 20.0
    ) -> GatedLoRALinear:
        out_dims, in_dims = linear.weight.shape
        in_dims *= packed_width_factor(linear)
        m = cls(input_dims=in_dims, output_dims=out_dims, r=r, dropout=0.0, scale=scale)
        m.linear = linear
        m.gate = gate
        return m

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        g = self.gate.value
        if g is None or g.shape[:-1] != x.shape[:-1]:
            raise UnsupportedModelError(
                "A gated MTP adapter needs the model to be called with token ids (its "
                "MaskedEmbedding marks the mask positions); this call passed none."
            )
        z = (x @ self.lora_a) @ self.lora_b
        return y + (self.scale * z * g).astype(x.dtype)

    def fuse(self, dequantize: bool = False) -> nn.Module:
        """Refused: a gated delta depends on the token, so it has no fused form.

        Raises:
            UnsupportedModelError: always.
        """
        raise UnsupportedModelError("A gated LoRA layer cannot be fused into its base weight.")


def gated_lora_layers(
    model: nn.Module, paths: list[str], gate: MaskGate, r: int, scale: float
) -> list[tuple[str, GatedLoRALinear]]:
    """A :class:`GatedLoRALinear` around each of ``model``'s linears at ``paths``
    (fresh LoRA weights, ``lora_b`` zero), all reading ``gate``; install them
    with ``model.update_modules(tree_unflatten(...))``."""
    return [(p, GatedLoRALinear.from_base(_get_module(model, p), gate, r, scale)) for p in paths]


class MaskedEmbedding(nn.Module):
    """An input embedding with one extra row for the MTP mask token.

    ``ids == mask_token_id`` look up ``mask_embedding`` (D,), every other id
    the base embedding. ``as_linear`` (tied LM head) is the base one: the mask
    token is an input-only token and never gets a logit of its own.

    Args:
        base: the model's ``nn.Embedding`` / ``nn.QuantizedEmbedding`` (not copied).
        mask_token_id: id of the mask token (may lie past the base rows).
        mask_embedding: (D,) vector.
        gate: where to record the mask positions of each forward pass, for the
            model's :class:`GatedLoRALinear` layers (None: not recorded).
    """

    def __init__(
        self,
        base: nn.Module,
        mask_token_id: int,
        mask_embedding: mx.array,
        gate: MaskGate | None = None,
    ):
        super().__init__()
        self.base = base
        self.mask_token_id = int(mask_token_id)
        self.mask_embedding = mask_embedding
        self.rows = int(base.weight.shape[0])
        self.gate = gate

    def __call__(self, ids: mx.array) -> mx.array:
        is_mask = mx.expand_dims(ids == self.mask_token_id, -1)
        if self.gate is not None:
            self.gate.value = is_mask.astype(mx.float32)
        e = self.base(mx.minimum(ids, self.rows - 1))
        return mx.where(is_mask, self.mask_embedding.astype(e.dtype), e)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.base.as_linear(x)


def clone_modules(module: nn.Module) -> nn.Module:
    """A copy of a module tree that shares every weight array with the original.

    Replacing a sub-module of the copy (a LoRA-fused linear, an embedding with
    a mask row) leaves the original untouched, at no memory cost.
    """
    c = copy.copy(module)
    c.__dict__["_no_grad"] = set(module.__dict__.get("_no_grad", set()))
    for key, value in module.items():
        if isinstance(value, nn.Module):
            c[key] = clone_modules(value)
        elif isinstance(value, list):
            c[key] = [clone_modules(v) if isinstance(v, nn.Module) else v for v in value]
    return c


def lora_modules(model: nn.Module, keys: list[str], num_layers: int) -> list[str]:
    """Paths (``model.layers.N.self_attn.q_proj`` ...) of the linears that
    :func:`mlx_lm.tuner.utils.linear_to_lora_layers` adapts for ``keys`` in the
    last ``num_layers`` layers."""
    layers = model.layers
    first = len(layers) - min(num_layers, len(layers))
    return [f"model.layers.{i}.{k}" for i in range(first, len(layers)) for k in keys]


def _get_module(root: nn.Module, path: str) -> nn.Module:
    m: Any = root
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def apply_adapter(model: nn.Module, adapter: Path, meta: dict[str, Any]) -> nn.Module:
    """A copy of ``model`` with an on-device MTP adapter applied.

    The embedding gets the mask-token row (:class:`MaskedEmbedding`). A gated
    adapter (``lora.gated``, the default of :mod:`mlx_mtp.training.mtp`) keeps
    its LoRA deltas as :class:`GatedLoRALinear` layers that act only at mask
    tokens, so next-token prediction stays the base model's. An ungated one is
    fused into copies of the adapted linears (``LoRALinear.fuse``; quantized
    linears stay quantized). The original model is not modified.

    Raises:
        CheckpointMismatchError: the adapter's tensors do not fit the model.
    """
    from mlx.utils import tree_unflatten

    weights = mx.load(str(adapter / ADAPTER_WEIGHTS))
    clone = clone_modules(model)
    lora = meta.get("lora") or {}
    gate = MaskGate() if lora.get("gated") else None
    fused = []
    dtype = model.model.embed_tokens.weight.dtype
    if not mx.issubdtype(dtype, mx.floating):
        dtype = mx.float16
    try:
        paths = lora.get("modules", [])
        r, scale = (int(lora["rank"]), float(lora["scale"])) if paths else (0, 0.0)
        if gate is not None:
            fused = gated_lora_layers(clone, paths, gate, r, scale)
            for path, g in fused:
                a = weights[f"{path}.lora_a"].astype(mx.float32)
                b = weights[f"{path}.lora_b"].astype(mx.float32)
                if a.shape != g.lora_a.shape or b.shape != g.lora_b.shape:
                    raise ValueError(f"{path} LoRA shapes {a.shape}, {b.shape}")
                g.lora_a, g.lora_b = a, b
        else:
            for path in paths:
                base = _get_module(clone, path)
                ll = LoRALinear.from_base(base, r=r, scale=scale)
                ll.lora_a = weights[f"{path}.lora_a"].astype(mx.float32)
                ll.lora_b = weights[f"{path}.lora_b"].astype(mx.float32)
                f = ll.fuse()
                if not isinstance(f, nn.QuantizedLinear):
                    f.weight = f.weight.astype(base.weight.dtype)
                fused.append((path, f))
        if fused:
            clone.update_modules(tree_unflatten(fused))
        row = weights["mask_embedding"].astype(dtype)
        base_emb = clone.model.embed_tokens
        if row.shape != (model_dims(clone)[0],):
            raise ValueError(f"mask_embedding has shape {row.shape}")
        clone.model.embed_tokens = MaskedEmbedding(base_emb, meta["mask_token_id"], row, gate)
    except (KeyError, ValueError, AttributeError) as e:
        raise CheckpointMismatchError(
            f"The MTP adapter in {adapter} does not fit this model ({type(e).__name__}: {e}). "
            "Train one for it with `mlx-mtp train mtp`."
        ) from e
    mx.eval(clone.parameters())
    return clone


def adapter_dirs() -> list[Path]:
    """Folders searched for on-device adapters: the cache's ``confadapt/``.

    The example adapter shipped in ``assets/confadapt/`` is NOT searched: it is
    gated (next-token prediction stays the base model's) but undertrained, so
    on SmolLM2 it emits about one token per forward pass and is slower than
    plain decoding (see the README); it is only used when asked for with
    ``adapter=<its folder>``.
    """
    from ..loading import cache_home

    out = []
    for root in (cache_home() / "confadapt",):
        if root.is_dir():
            out += sorted(p for p in root.iterdir() if (p / ADAPTER_CONFIG).is_file())
    return out


def read_adapter_config(folder: Path) -> dict[str, Any]:
    """The :data:`ADAPTER_CONFIG` dict of an adapter folder.

    Raises:
        CheckpointMismatchError: missing or invalid file.
    """
    f = Path(folder) / ADAPTER_CONFIG
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointMismatchError(
            f"{folder} is not an MTP adapter folder ({f.name}: {e}); train one with "
            "`mlx-mtp train mtp --lora`."
        ) from e


def find_adapter(fingerprint: str) -> Path | None:
    """The first adapter folder (see :func:`adapter_dirs`) made for this base model."""
    for d in adapter_dirs():
        try:
            if read_adapter_config(d).get("base_fingerprint") == fingerprint:
                return d
        except CheckpointMismatchError:
            continue
    return None


def no_mask_token_message(what: str) -> str:
    return (
        f"{what} has no MTP mask token {MASK_TOKEN!r} and no MTP adapter was found for it, "
        "so --method confadapt cannot decode with it. Use a self-distilled checkpoint "
        "(`mlx-mtp convert mtp-checkpoint jwkirchenbauer/Qwen3-4B-Inst-2507-MTP DIR`), or "
        "adapt this model on your own prompts: `mlx-mtp train mtp --model MODEL --data "
        "prompts.jsonl --lora`."
    )


# ------------------------------------------------------------------ decoding
class ConfAdapt(Method):
    """ConfAdapt(tau) and static-k decoding of a self-distilled MTP model.

    Args:
        k: block size, tokens predicted per forward pass (1 + k-1 masks);
            default 16.
        tau: confidence threshold in [0, inf): keep the leading tokens whose
            top-1 probability is >= tau (at least one). ``tau > 1`` is plain
            greedy decoding; ``tau = 0`` keeps all k (static-k).
        mode: ``"confadapt"`` (default) or ``"static"`` (keep all k).
        adapter: folder of an on-device adapter (``mlx-mtp train mtp``);
            default: found by the model's fingerprint.

    Raises:
        InvalidArgumentError: bad k, tau or mode.
        MissingMaskTokenError (in :meth:`prepare`): no mask token, no adapter.

    Cache contract: after :meth:`step` the cache holds the committed tokens up
    to this step's root; the step's emitted tokens except the last are kept in
    ``self.pending`` and fed, before the new root, at the next step.
    """

    name = "confadapt"
    lossless = False

    def __init__(self, k: Any = 16, tau: Any = 0.9, mode: str = "confadapt", adapter: Any = None):
        self.k = parse_int("k", k, 1, 64)
        try:
            self.tau = float(tau)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"option tau must be a number, got {tau!r}") from None
        if not np.isfinite(self.tau) or self.tau < 0:
            raise InvalidArgumentError(f"option tau must be >= 0, got {self.tau}")
        if mode not in ("confadapt", "static"):
            raise InvalidArgumentError(f"option mode must be 'confadapt' or 'static', got {mode!r}")
        self.static = mode == "static"
        self.adapter = None if adapter in (None, "") else Path(str(adapter)).expanduser()
        self.meta: MTPMetadata | None = None
        self.pending: list[int] = []

    @property
    def block_complexity(self) -> int:
        return self.k

    def describe(self) -> str:
        # the stats line's "tau" (tokens per forward) is the paper's Eff. k; the
        # confidence threshold is printed as "conf>=" to keep the two apart
        rule = "static" if self.static else f"conf>={self.tau:g}"
        return f"confadapt(k={self.k}, {rule})"

    # -------------------------------------------------------------- setup
    def prepare(self, engine: Engine) -> None:
        """Find the mask token (and apply an on-device adapter if that is where
        it comes from). With an adapter, ``engine`` gets a copy of its model
        with the adapter applied (:func:`apply_adapter`); the caller's model
        object is not modified.

        Raises:
            MissingMaskTokenError: neither the model nor an adapter has a mask token.
            CheckpointMismatchError: an adapter made for another base model.
        """
        if engine.backbone is None:
            raise UnsupportedModelError(
                "--method confadapt needs the llama-style model layout (model.embed_tokens)."
            )
        loaded = getattr(engine, "loaded", None)
        refuse_sharded_adapter(engine.model, loaded, self.adapter)
        meta, adapter = find_mtp_source(engine.model, loaded, self.adapter)
        if adapter is not None:
            cfg = read_adapter_config(adapter)
            engine.model = apply_adapter(engine.model, adapter, cfg)
            engine.backbone, engine.lm_head, engine.embed = model_parts(engine.model)
            engine.cache = make_prompt_cache(engine.model, engine.max_kv_size)
            engine.cached = []
        self.meta = meta
        self.mask_id = meta.mask_token_id
        self.eos = set(meta.eos_token_ids)

    def begin(self, engine: Engine, prompt: list[int], sampler: Sampler | None) -> None:
        super().begin(engine, prompt, sampler)
        self.pending = []

    # --------------------------------------------------------------- step
    def step(self, engine: Engine, root: int) -> StepOutput:
        k = self.k
        real = [*self.pending, root]
        engine._require_trimmable(len(real) + k - 1)
        start = engine.offset
        logits, _ = engine.forward_chain(real + [self.mask_id] * (k - 1))
        # the root and the k-1 masks give k next-token distributions
        dist = logits[len(real) - 1 :].astype(mx.float32)
        if self.mask_id < dist.shape[-1]:  # the mask token is input-only
            col = mx.arange(dist.shape[-1]) == self.mask_id
            dist = mx.where(col, -mx.inf, dist)
        logp = dist - mx.logsumexp(dist, axis=-1, keepdims=True)
        conf = mx.exp(mx.max(logp, axis=-1))
        if self.sampler is None:
            toks = mx.argmax(logp, axis=-1)
        else:
            toks = draw(self.sampler, logp, engine.slot_positions[len(real) - 1 :] + 1)
        engine.timed_eval(toks, conf)
        toks_np, conf_np = np.array(toks).tolist(), np.array(conf)
        # drop the masks' KV; the root's KV is exact and stays
        engine.trim_to(start + len(real))

        n = k if self.static else confadapt_length(conf_np, self.tau)
        out = toks_np[:n]
        for i, t in enumerate(out):  # the block ends at its first EOS
            if t in self.eos:
                out = out[: i + 1]
                break
        self.pending = out[:-1]
        return StepOutput([int(t) for t in out], drafted=k - 1, accepted=len(out) - 1)


def confadapt_length(confidence: np.ndarray, tau: float) -> int:
    """ConfAdapt's rule: the number of leading tokens whose top-1 probability
    is >= tau, at least one (Kirchenbauer et al. §3).

    Args:
        confidence: (k,) top-1 probabilities of the k positions of a block.
        tau: threshold; tau > 1 always gives 1, tau = 0 gives k.
    """
    below = np.flatnonzero(np.asarray(confidence) < tau)
    n = int(below[0]) if below.size else len(confidence)
    return max(n, 1)


def refuse_sharded_adapter(model: nn.Module, loaded: Any, adapter: Path | None) -> None:
    """Refuse an on-device adapter on a model sharded over several ranks
    (:mod:`mlx_mtp.distributed`): the adapter's LoRA tensors are made for the
    whole model and are not sharded. A checkpoint with the mask token built in
    (``mtp_config.json`` or the tokenizer's token) needs no adapter and runs
    sharded.

    Raises:
        UnsupportedModelError: naming the sharding and what to use instead.
    """
    from .. import distributed

    how = distributed.sharding(model)
    if how is None:
        return
    built_in = loaded is not None and (
        read_metadata(loaded.path) is not None
        or tokenizer_mask_id(getattr(loaded, "tokenizer", None)) is not None
    )
    if adapter is None and built_in:
        return
    raise UnsupportedModelError(
        f"--method confadapt: this model is sharded ({how} parallel) and its mask "
        "token would come from an on-device "
        "adapter, whose LoRA weights are made for the unsharded model and are not "
        "sharded. Use a released MTP checkpoint with the mask token built in (e.g. "
        "qwen3-4b-mtp), or run confadapt in one process."
    )


def find_mtp_source(
    model: nn.Module, loaded: Any = None, adapter: Path | None = None
) -> tuple[MTPMetadata, Path | None]:
    """Where the mask token of ``model`` comes from (see the module docstring).

    Args:
        model: the loaded mlx-lm model.
        loaded: its :class:`~mlx_mtp.loading.LoadedModel` (folder, tokenizer)
            when known.
        adapter: an explicit adapter folder.

    Returns:
        The metadata and, if the mask token comes from an on-device adapter,
        that adapter's folder (None for a checkpoint with the token built in).

    Raises:
        MissingMaskTokenError, CheckpointMismatchError.
    """
    from ..fingerprint import model_fingerprint

    tokenizer = getattr(loaded, "tokenizer", None)
    eos = tokenizer_eos_ids(tokenizer) if tokenizer is not None else []
    if adapter is None and loaded is not None:
        meta = read_metadata(loaded.path)
        tok_id = tokenizer_mask_id(tokenizer)
        if meta is not None:
            if tok_id is not None and tok_id != meta.mask_token_id:
                raise CheckpointMismatchError(
                    f"{loaded.path / MTP_CONFIG} says the mask token id is "
                    f"{meta.mask_token_id} but the tokenizer has {MASK_TOKEN} at {tok_id}; "
                    "convert the checkpoint again."
                )
            meta.eos_token_ids = meta.eos_token_ids or eos
            return meta, None
        if tok_id is not None:
            fmt = "plain" if getattr(model, "model_type", "") == "qwen3" else "chat"
            return MTPMetadata(tok_id, eos, fmt, source=str(loaded.path)), None
    fp = model_fingerprint(model)
    if adapter is None:
        adapter = find_adapter(fp)
    if adapter is None:
        what = f"The model {loaded.name!r}" if loaded is not None else "This model"
        raise MissingMaskTokenError(no_mask_token_message(what))
    cfg = read_adapter_config(adapter)
    if cfg.get("base_fingerprint") != fp:
        raise CheckpointMismatchError(
            f"The MTP adapter in {adapter} was trained for the base model "
            f"{cfg.get('base_model', '?')!r} (fingerprint {cfg.get('base_fingerprint')}), not "
            f"this one (fingerprint {fp}). Train one for this model with `mlx-mtp train mtp`."
        )
    meta = MTPMetadata(
        mask_token_id=int(cfg["mask_token_id"]),
        eos_token_ids=eos or [int(x) for x in cfg.get("eos_token_ids", [])],
        prompt_format=cfg.get("prompt_format", "chat"),
        k=int(cfg.get("k", 16)),
        source=str(adapter),
    )
    return meta, adapter
