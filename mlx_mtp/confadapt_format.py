"""Self-distilled MTP checkpoints and adapters: the library behind ``confadapt``.

Kirchenbauer et al., *Multi-Token Prediction via Self-Distillation* (arXiv
2602.06019; docs/methods.md, confadapt). Used by the ``confadapt`` decoding method
(:mod:`mlx_mtp.methods.confadapt`), by on-device training
(:mod:`mlx_mtp.training.mtp`, ``mlx-mtp train mtp``) and by the checkpoint
converter (``mlx-mtp convert mtp-checkpoint``):

- :class:`MTPMetadata` and ``mtp_config.json`` (:data:`MTP_CONFIG`): the mask
  token id, EOS ids and prompt format of a converted or adapted model;
- the mask token in a tokenizer (:func:`tokenizer_mask_id`);
- embedding surgery for a mask token the base vocabulary lacks
  (:class:`MaskedEmbedding`) and gated LoRA whose deltas act on mask positions
  only (:class:`GatedLoRALinear`, :class:`MaskGate`);
- on-device adapters: their folder format (:data:`ADAPTER_CONFIG`,
  :data:`ADAPTER_WEIGHTS`), discovery by model fingerprint
  (:func:`find_adapter`) and application to a loaded model
  (:func:`apply_adapter`).

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
from mlx.utils import tree_unflatten
from mlx_lm.tuner.lora import LoRALinear

from .artifacts import ASSETS, find_artifact, search_dirs
from .data import PROMPT_FORMATS
from .dims import model_dims, packed_width_factor
from .errors import CheckpointMismatchError, UnsupportedModelError
from .fingerprint import model_fingerprint, same_model

#: the mask token string of the released checkpoints (Qwen3-4B id 151669, Llama-3.1-8B 128259)
MASK_TOKEN = "<|mtp_special_token_0|>"
#: metadata file in a converted or adapted model folder
MTP_CONFIG = "mtp_config.json"
#: metadata file of an on-device LoRA adapter folder
ADAPTER_CONFIG = "mtp_adapter.json"
ADAPTER_WEIGHTS = "adapter.safetensors"
#: adapters shipped with the package (one sub-folder each)
SHIPPED_ADAPTERS = ASSETS / "confadapt"


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
    return [(p, GatedLoRALinear.from_base(get_module(model, p), gate, r, scale)) for p in paths]


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


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The sub-module of ``root`` at a dotted ``path`` (``"model.layers.3.mlp"``)."""
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
                base = get_module(clone, path)
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


def find_adapter(model: nn.Module | str) -> Path | None:
    """The first adapter folder in the cache's ``confadapt/`` made for this
    base model: ``model`` itself (fingerprint, else the signature of the same
    weights at another precision, :func:`~mlx_mtp.fingerprint.same_model`) or
    a fingerprint string (exact match only).

    The example adapter shipped in ``assets/confadapt/`` is NOT searched: it is
    gated (next-token prediction stays the base model's) but undertrained, so
    on SmolLM2 it emits about one token per forward pass and is slower than
    plain decoding (docs/methods.md, confadapt); it is only used when asked for with
    ``adapter=<its folder>``.
    """
    roots = search_dirs("confadapt", shipped=False)
    keys = ("base_fingerprint", "base_signature")
    return find_artifact(model, roots, f"*/{ADAPTER_CONFIG}", keys=keys)


def no_mask_token_message(what: str) -> str:
    return (
        f"{what} has no MTP mask token {MASK_TOKEN!r} and no MTP adapter was found for it, "
        "so --method confadapt cannot decode with it. Use a self-distilled checkpoint "
        "(`mlx-mtp convert mtp-checkpoint jwkirchenbauer/Qwen3-4B-Inst-2507-MTP DIR`), or "
        "adapt this model on your own prompts: `mlx-mtp train mtp --model MODEL --data "
        "prompts.jsonl --lora`."
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
    if adapter is None:
        adapter = find_adapter(model)
    if adapter is None:
        what = f"The model {loaded.name!r}" if loaded is not None else "This model"
        raise MissingMaskTokenError(no_mask_token_message(what))
    cfg = read_adapter_config(adapter)
    if not same_model(model, cfg.get("base_fingerprint"), cfg.get("base_signature")):
        fp = model_fingerprint(model)
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
