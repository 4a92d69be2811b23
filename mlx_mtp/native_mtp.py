"""The multi-token-prediction layer that Qwen3.5 / Qwen3.6 and Qwen3-Next
checkpoints ship under ``mtp.*`` (and that mlx-lm's ``sanitize`` drops).

The layer (Qwen3-Next / Qwen3.5 technical reports; the layout every public
runtime loads, e.g. vLLM's ``Qwen3NextMultiTokenPredictor``)::

    x   = fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)])
    x   = DecoderLayer(x)              # one full-attention block of the backbone's
                                       # own kind, with its OWN KV cache over the
                                       # MTP positions (causal), RoPE at the token's
                                       # position
    o_i = norm(x)                      # logits = backbone LM head(o_i) -> t_{i+2}

``h_i`` is the backbone's hidden state at position i (``hidden_state``
``"final-norm"``: the final-norm output that the LM head reads, as vLLM, SGLang
and LightLLM feed it; ``"pre-norm"``: the last decoder layer's output before
that norm), ``embed`` and the LM head are the backbone's. The concatenation
puts the embedding first (the reverse of MiMo's ``input_proj``). Beyond depth 1
the layer is re-fed its own output ``o`` with the token it drafted, as the
public runtimes do when ``num_nextn_predict_layers`` is 1.

Checkpoint names (after the prefix up to ``mtp.``, which is ``mtp.`` in both
the Qwen3-Next and the Qwen3.5 (VL) checkpoints): ``fc.weight`` (D, 2D),
``pre_fc_norm_hidden.weight``, ``pre_fc_norm_embedding.weight``,
``norm.weight``, ``layers.0.input_layernorm.weight``,
``layers.0.post_attention_layernorm.weight``, ``layers.0.self_attn.{q,k,v,o}_proj.weight``
(q_proj has 2x rows: query and output gate), ``layers.0.self_attn.{q,k}_norm.weight``,
and the MLP: dense ``layers.0.mlp.{gate,up,down}_proj.weight`` (Qwen3.5 dense),
or MoE ``layers.0.mlp.gate.weight``, ``layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight``
(Qwen3-Next) or fused ``layers.0.mlp.experts.gate_up_proj`` / ``experts.down_proj``
(Qwen3.5-MoE), ``layers.0.mlp.shared_expert.*``, ``layers.0.mlp.shared_expert_gate.weight``.
The RMSNorm weights are stored zero-centred (``x * (1 + w)``) in the Hugging
Face checkpoints; they get the same ``+1`` mlx-lm's ``sanitize`` gives the
backbone's norms, under the same rule (the checkpoint's conv1d weights are in
the Hugging Face layout). Quantized MTP tensors (``*.scales``/``*.biases`` of an
MLX-quantized checkpoint) are quantized like the rest (the config's
``quantization``), and dequantized when the backbone was.

The decoder block is built from the backbone's own mlx-lm class (the class of
its first full-attention layer, MLP or MoE block from
``mlx_lm.models.qwen3_next``): no model file is forked.

DeepSeek-V3 ``nextn`` (DeepSeek-V3 technical report, §2.2 "Multi-Token
Prediction"; the layout vLLM's ``DeepSeekMTP`` loads): the checkpoint stores
the layer as one more decoder layer, ``model.layers.{num_hidden_layers}.*``
(``model.layers.61`` in DeepSeek-V3/R1), which mlx-lm's ``sanitize`` drops::

    x   = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])
    x   = DeepseekV3DecoderLayer(x)   # MLA attention + MoE, mlx-lm's own class,
                                      # layer index num_hidden_layers
    o_i = shared_head.norm(x)         # logits = LM head(o_i) -> t_{i+2}

``shared_head.head`` and ``embed_tokens`` under that prefix are copies of the
backbone's LM head and embedding (the backbone's are used). Its norms are plain
``x * w``; its tensors go through mlx-lm's own ``sanitize`` (experts stacked,
``kv_b_proj`` split into MLA's ``embed_q`` / ``unembed_out``, FP8 dequantized)
under a borrowed layer index. Only the first nextn layer is loaded
(``num_nextn_predict_layers`` is 1 in every released checkpoint).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import dequantize_model

from .dims import text_args
from .errors import ModelLoadError, UnsupportedModelError

#: mlx-lm model types whose checkpoints carry a native MTP layer under ``mtp.*``
MTP_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
#: mlx-lm model types whose checkpoints carry DeepSeek ``nextn`` layers
NEXTN_FAMILIES = ("deepseek_v3",)
#: every model type with a native MTP layer this package loads
NATIVE_FAMILIES = MTP_FAMILIES + NEXTN_FAMILIES
HIDDEN_STATES = ("final-norm", "pre-norm")
#: forward passes a hidden-state tap remembers (prefill chunks of one prompt)
MAX_TAP_RECORDS = 256

_NORM_SUFFIXES = (
    "pre_fc_norm_hidden.weight",
    "pre_fc_norm_embedding.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


# ------------------------------------------------------------- checkpoint
def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head


def mtp_prefix(name: str) -> str | None:
    """The part of a tensor name after ``mtp.`` (``mtp.fc.weight`` ->
    ``fc.weight``, also under ``model.`` / ``language_model.`` prefixes), or
    None for a name outside the MTP layer."""
    if name.startswith("mtp."):
        return name[4:]
    i = name.find(".mtp.")
    return name[i + 5 :] if i >= 0 else None


def find_mtp_tensors(folder: str | Path) -> dict[str, tuple[Path, list[int]]]:
    """The MTP tensors of a checkpoint folder, read from the safetensors headers
    only: ``{name after "mtp.": (file, shape)}`` (empty when it has none)."""
    out: dict[str, tuple[Path, list[int]]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            head = _header(f)
        except (OSError, ValueError, struct.error):
            continue
        for name, meta in head.items():
            short = mtp_prefix(name)
            if short is not None:
                out[short] = (f, list(meta.get("shape", [])))
    return out


def _hf_layout(folder: Path) -> bool:
    # mlx-lm's rule for "this checkpoint is not sanitized yet": conv1d weights
    # in the Hugging Face (C, 1, K) layout
    for f in sorted(folder.glob("*.safetensors")):
        try:
            head = _header(f)
        except (OSError, ValueError, struct.error):
            continue
        for name, meta in head.items():
            if "conv1d.weight" in name and mtp_prefix(name) is None:
                return meta.get("shape", [1])[-1] != 1
    return False


def read_mtp_weights(folder: str | Path, num_experts: int = 0) -> dict[str, mx.array]:
    """The MTP layer's tensors of a checkpoint folder, mapped to
    :class:`NativeMTPLayer` names (experts stacked, norms shifted; see module
    doc). Lazy: only these tensors are read when evaluated.

    Raises:
        ModelLoadError: the folder has no ``mtp.*`` tensors, or they cannot be read.
    """
    folder = Path(folder)
    found = find_mtp_tensors(folder)
    if not found:
        raise ModelLoadError(
            f"{folder} has no mtp.* tensors: this checkpoint ships no native MTP layer (MLX "
            "conversions made with mlx_lm.convert drop it; use the original Hugging Face "
            "checkpoint), or use another --method."
        )
    by_file: dict[Path, list[str]] = {}
    for short, (f, _) in found.items():
        by_file.setdefault(f, []).append(short)
    w: dict[str, mx.array] = {}
    for f, shorts in by_file.items():
        try:
            arrays = mx.load(str(f))
        except Exception as e:
            raise ModelLoadError(f"{f} cannot be read ({type(e).__name__}: {e})") from e
        full = {mtp_prefix(n): n for n in arrays if mtp_prefix(n) is not None}
        for s in shorts:
            w[s] = arrays[full[s]]
    # MoE experts: per-expert tensors (Qwen3-Next) or fused (Qwen3.5-MoE) -> SwitchGLU
    layers = sorted({int(k.split(".")[1]) for k in w if k.startswith("layers.")})
    for layer in layers:
        p = f"layers.{layer}.mlp"
        if f"{p}.experts.gate_up_proj" in w:
            gu = w.pop(f"{p}.experts.gate_up_proj")
            mid = gu.shape[-2] // 2
            w[f"{p}.switch_mlp.gate_proj.weight"] = gu[..., :mid, :]
            w[f"{p}.switch_mlp.up_proj.weight"] = gu[..., mid:, :]
            w[f"{p}.switch_mlp.down_proj.weight"] = w.pop(f"{p}.experts.down_proj")
        for n in ("gate_proj", "up_proj", "down_proj"):
            for kind in ("weight", "scales", "biases"):
                keys = [f"{p}.experts.{e}.{n}.{kind}" for e in range(num_experts)]
                if num_experts and keys[0] in w:
                    w[f"{p}.switch_mlp.{n}.{kind}"] = mx.stack([w.pop(k) for k in keys])
    if _hf_layout(folder):
        for k, v in list(w.items()):
            if (k.endswith(_NORM_SUFFIXES) or k == "norm.weight") and v.ndim == 1:
                w[k] = v + 1.0
    return w


def has_native_mtp(folder: str | Path, model: nn.Module) -> bool:
    """Whether ``folder`` holds a native MTP layer for ``model``: the model's
    own checkpoint with ``mtp.*`` tensors (a supported model type), or a heads
    folder of architecture ``native-mtp-layer``. Reads headers only."""
    from .clp_format import FORMAT, NATIVE_LAYER

    folder = Path(folder)
    mtype = getattr(model, "model_type", "")
    if mtype in NEXTN_FAMILIES:
        return bool(find_nextn_tensors(folder, int(model.args.num_hidden_layers)))
    if mtype not in NATIVE_FAMILIES:
        return False
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    if config.get("format") == FORMAT:
        return config.get("architecture") == NATIVE_LAYER
    return bool(find_mtp_tensors(folder))


def find_nextn_tensors(folder: str | Path, num_hidden_layers: int) -> dict[str, Path]:
    """The DeepSeek nextn tensors of a checkpoint folder (headers only):
    ``{name after "model.layers.{num_hidden_layers}.": file}``."""
    prefix = f"model.layers.{num_hidden_layers}."
    out: dict[str, Path] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            head = _header(f)
        except (OSError, ValueError, struct.error):
            continue
        for name in head:
            if name.startswith(prefix):
                out[name[len(prefix) :]] = f
    return out


#: nextn tensors that copy the backbone's (its embedding and LM head are used)
_NEXTN_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def read_nextn_weights(folder: str | Path, model: nn.Module) -> dict[str, mx.array]:
    """The first DeepSeek nextn layer's tensors, mapped to :class:`NextNLayer`
    names through mlx-lm's own ``sanitize`` (lazy).

    Raises:
        ModelLoadError: no ``model.layers.{num_hidden_layers}.*`` tensors, or
            they cannot be read.
    """
    folder = Path(folder)
    n = int(model.args.num_hidden_layers)
    found = find_nextn_tensors(folder, n)
    if not found:
        raise ModelLoadError(
            f"{folder} has no nextn tensors (model.layers.{n}.*): this checkpoint ships no "
            "native MTP layer (MLX conversions made with mlx_lm.convert drop it; use the "
            "original Hugging Face checkpoint), or use another --method."
        )
    raw: dict[str, mx.array] = {}
    for f in sorted(set(found.values())):
        try:
            arrays = mx.load(str(f))
        except Exception as e:
            raise ModelLoadError(f"{f} cannot be read ({type(e).__name__}: {e})") from e
        prefix = f"model.layers.{n}."
        for name, v in arrays.items():
            short = name[len(prefix) :] if name.startswith(prefix) else None
            if short is not None and short not in _NEXTN_COPIES:
                # a borrowed index for mlx-lm's sanitize (it skips model.layers.61)
                raw[f"model.layers.0.{short}"] = v
    w = {}
    for k, v in model.sanitize(raw).items():
        short = k[len("model.layers.0.") :]
        if short.startswith(("enorm.", "hnorm.", "eh_proj.")):
            w[short] = v
        elif short.startswith("shared_head.norm."):
            w["norm." + short[len("shared_head.norm.") :]] = v
        else:
            w["layers.0." + short] = v
    return w


class NextNLayer(nn.Module):
    """DeepSeek-V3's nextn layer (see module doc), the decoder block built
    from mlx-lm's ``DeepseekV3DecoderLayer`` at layer index
    ``num_hidden_layers`` (MoE or dense by the config's own rule).

    Call as :class:`NativeMTPLayer`: ``h`` (1, L, D) backbone hidden states
    at positions i, ``e`` (1, L, D) embeddings of tokens i+1, ``cache`` (one
    ``KVCache``, MLA's latent cache); returns (1, L, D) states whose LM-head
    logits predict tokens i+2.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

        args = model.args
        d, eps = int(args.hidden_size), float(args.rms_norm_eps)
        self.enorm = nn.RMSNorm(d, eps=eps)
        self.hnorm = nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.layers = [DeepseekV3DecoderLayer(args, int(args.num_hidden_layers))]
        self.norm = nn.RMSNorm(d, eps=eps)

    @property
    def fc(self) -> nn.Module:
        """The input projection (``eh_proj``; ``fc`` in the Qwen layout)."""
        return self.eh_proj

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, h: mx.array, e: mx.array, cache: list[Any], step: int = 0) -> mx.array:
        x = mx.concatenate([self.enorm(e.astype(h.dtype)), self.hnorm(h)], axis=-1)
        x = self.eh_proj(x)
        mask = create_attention_mask(x, cache[0], return_array=True)
        x = self.layers[0](x, mask, cache[0])
        return self.norm(x)


# ------------------------------------------------------------------ layer
class NativeMTPLayer(nn.Module):
    """The checkpoint's MTP layer (see module doc), built from the backbone's
    own mlx-lm decoder-layer class.

    Args:
        model: the backbone (qwen3_5, qwen3_5_moe or qwen3_next).
        moe: whether the block's MLP is a sparse MoE (else dense).
        n_layers: MTP decoder blocks (``mtp_num_hidden_layers``; 1 in every
            released checkpoint).

    Call with ``h`` (1, L, D) backbone hidden states at positions i, ``e`` (1,
    L, D) input embeddings of tokens i+1, and ``cache`` (one ``KVCache`` per
    block); returns (1, L, D) states whose LM-head logits predict tokens i+2.
    """

    def __init__(self, model: nn.Module, moe: bool, n_layers: int = 1):
        super().__init__()
        from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock

        args = text_args(model)
        d, eps = int(args.hidden_size), float(args.rms_norm_eps)
        full = [layer for layer in model.layers if not getattr(layer, "is_linear", True)]
        if not full:
            raise UnsupportedModelError(
                "the model has no full-attention layer to build its MTP block from"
            )
        block_cls = type(full[0])
        idx = int(getattr(args, "full_attention_interval", 4)) - 1
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=eps)
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = []
        for _ in range(n_layers):
            block = block_cls(args, idx)
            block.mlp = (
                Qwen3NextSparseMoeBlock(args) if moe else Qwen3NextMLP(d, args.intermediate_size)
            )
            self.layers.append(block)
        self.norm = nn.RMSNorm(d, eps=eps)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def __call__(self, h: mx.array, e: mx.array, cache: list[Any], step: int = 0) -> mx.array:
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(e.astype(h.dtype)), self.pre_fc_norm_hidden(h)], axis=-1
        )
        x = self.fc(x)
        i = step % len(self.layers)
        mask = create_attention_mask(x, cache[i])
        x = self.layers[i](x, mask, cache[i])
        return self.norm(x)


def draft_cost_of(layer: Any, model: Any) -> float:
    """Cost of one MTP draft (the layer's pass and the LM head) relative to a
    one-token forward of the backbone: the ratio of the weight bytes each
    reads, which is what a memory-bound decode step costs (the input
    embedding is a lookup, not read whole; a tied LM head is the embedding
    matrix). On a MoE model every expert counts on both sides.

    Returns:
        The ratio (float >= 0).
    """
    params = tree_flatten(model.parameters())
    total = sum(v.nbytes for _, v in params)
    emb = sum(v.nbytes for k, v in params if "embed_tokens" in k)
    tied = not any("lm_head" in k for k, _ in params)
    head = emb  # (V, D) either way: the embedding itself, or an untied head of its size
    backbone = total - emb + (emb if tied else 0)
    if backbone <= 0:
        return 0.0
    layer_bytes = sum(v.nbytes for _, v in tree_flatten(layer.parameters()))
    return (layer_bytes + head) / backbone


def compute_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype a backbone computes in: its embedding's weight dtype,
    or for a quantized embedding the dtype of its scales (what quantized
    matmuls return), else that of the final norm's weight; float32 when none
    of them is floating."""
    from .errors import UnsupportedModelError
    from .fingerprint import token_embedding

    try:
        emb = token_embedding(model)
    except UnsupportedModelError:
        return mx.float32
    norm = getattr(getattr(model, "model", None), "norm", None)
    for w in (
        getattr(emb, "weight", None),
        getattr(emb, "scales", None),
        getattr(norm, "weight", None),
    ):
        if w is not None and mx.issubdtype(w.dtype, mx.floating):
            return w.dtype
    return mx.float32


def load_native_mtp(
    folder: str | Path, model: nn.Module, config: dict[str, Any] | None = None
) -> NativeMTPLayer:
    """Load the ``mtp.*`` layer of the checkpoint in ``folder`` for ``model``.

    Args:
        folder: the model's checkpoint folder (its safetensors files).
        model: the loaded backbone.
        config: the folder's config (for ``quantization``); read from
            ``folder/config.json`` when None.

    Returns:
        The layer in the backbone's compute dtype (:func:`compute_dtype`: on a
        quantized backbone that of its scales, e.g. bfloat16), quantized when
        the checkpoint's MTP tensors are and the backbone is still quantized.

    Raises:
        UnsupportedModelError: the model type has no native MTP layer here.
        ModelLoadError: no ``mtp.*`` tensors, or tensors that do not fit.
    """
    mtype = getattr(model, "model_type", "")
    if mtype not in NATIVE_FAMILIES:
        raise UnsupportedModelError(
            f"--method mtp needs a checkpoint with a native MTP layer ({', '.join(NATIVE_FAMILIES)}"
            f"); model type {mtype!r} has none. Use --method probe, pld or clp."
        )
    from .clp_format import FORMAT, NATIVE_LAYER, check_compatible, read_heads

    folder = Path(folder)
    try:
        on_disk = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        on_disk = {}
    layer: nn.Module
    if on_disk.get("format") == FORMAT:  # a heads folder (convert clp-heads)
        config, w = read_heads(folder)
        if config["architecture"] != NATIVE_LAYER:
            raise ModelLoadError(
                f"{folder} holds CLP heads ({config['architecture']}), not a native MTP layer; "
                "use them with --method clp."
            )
        check_compatible(config, model, str(folder))
        if bool(config.get("nextn")) != (mtype in NEXTN_FAMILIES):
            raise ModelLoadError(
                f"{folder} holds a {'DeepSeek nextn' if config.get('nextn') else 'Qwen mtp'} "
                f"layer, which a {mtype} model cannot run; pass the model it was converted for."
            )
        if config.get("nextn"):
            layer = NextNLayer(model)
        else:
            layer = NativeMTPLayer(model, bool(config["moe"]), int(config["mtp_layers"]))
    elif mtype in NEXTN_FAMILIES:  # DeepSeek nextn: model.layers.{num_hidden_layers}.*
        config = on_disk if config is None else config
        w = read_nextn_weights(folder, model)
        layer = NextNLayer(model)
    else:
        config = on_disk if config is None else config
        args = text_args(model)
        w = read_mtp_weights(folder, int(getattr(args, "num_experts", 0) or 0))
        n_layers = len({k.split(".")[1] for k in w if k.startswith("layers.")})
        if n_layers == 0:
            raise ModelLoadError(
                f"{folder}: the mtp.* tensors have no decoder block (mtp.layers.0)"
            )
        moe = any(".mlp.switch_mlp." in k or k.endswith(".mlp.gate.weight") for k in w)
        layer = NativeMTPLayer(model, moe, n_layers)
    quantized = any(k.endswith(".scales") for k in w)
    if quantized:
        q = config.get("quantization") or config.get("quantization_config") or {}
        nn.quantize(
            layer,
            group_size=int(q.get("group_size", 64)),
            bits=int(q.get("bits", 4)),
            class_predicate=lambda p, m: f"{p}.scales" in w,
        )
    ref = dict(tree_flatten(layer.parameters()))
    missing = sorted(set(ref) - set(w))
    extra = sorted(set(w) - set(ref))
    bad = [k for k in set(ref) & set(w) if tuple(ref[k].shape) != tuple(w[k].shape)]
    if missing or extra or bad:
        raise ModelLoadError(
            f"{folder}: the mtp.* tensors do not fit a {mtype} MTP layer: missing {missing[:4]}, "
            f"unexpected {extra[:4]}, wrong shapes {sorted(bad)[:4]}."
        )
    emb = model.model.embed_tokens.weight
    # float tensors kept in float32 by the model class (DeepSeek's router bias)
    keep32 = getattr(model, "cast_predicate", lambda k: True)
    backbone_quantized = not mx.issubdtype(emb.dtype, mx.floating)
    dtype = compute_dtype(model)
    layer.load_weights(
        [
            (k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and keep32(k) else v)
            for k, v in w.items()
        ],
        strict=True,
    )
    if quantized and not backbone_quantized:
        layer = dequantize_model(layer)
        layer.set_dtype(dtype)
    layer.eval()
    mx.eval(layer.parameters())
    return layer


#: layers loaded by :func:`native_layer_for`: (model id, folder, backbone
#: embedding dtype) -> layer, dropped when the model is collected
_LOADED: dict[tuple[int, str, str], nn.Module] = {}


def native_layer_for(
    folder: str | Path, model: nn.Module, config: dict[str, Any] | None = None
) -> nn.Module:
    """:func:`load_native_mtp`, once per model and folder in this process:
    a later call for the same backbone (same object, same dtype) and folder
    returns the layer already loaded (the layer holds no decoding state:
    each user makes its own cache with ``make_cache``), so a batch or a
    method bound again does not read the checkpoint's MTP tensors again.

    Raises:
        The errors of :func:`load_native_mtp`; nothing is kept after one.
    """
    import weakref

    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    dtype = getattr(getattr(embed, "weight", None), "dtype", None)
    key = (id(model), str(Path(folder).resolve()), str(dtype))
    layer = _LOADED.get(key)
    if layer is None:
        layer = load_native_mtp(folder, model, config)
        _LOADED[key] = layer
        weakref.finalize(model, _LOADED.pop, key, None)
    return layer


# ------------------------------------------------------------ hidden tap
class _TapRecord:
    def __init__(self) -> None:
        self.inputs: list[mx.array] = []
        self.outputs: list[mx.array] = []


_TAP_CLASSES: dict[type, type] = {}


def install_hidden_tap(model: nn.Module) -> _TapRecord:
    """Record the backbone's final norm's input (pre-norm hidden state) and
    output (final-norm hidden state) of every forward pass, shape (1, L, D)
    each, by swapping the norm instance's class for a recording subclass
    (parameters, names and outputs unchanged; idempotent).

    Returns:
        The record; the caller empties its lists after reading them.
    """
    norm = model.model.norm
    rec = norm.__dict__.get("_mtp_tap")
    if rec is not None:
        return rec
    cls = type(norm)
    if cls not in _TAP_CLASSES:

        def __call__(self, x: mx.array) -> mx.array:
            y = cls.__call__(self, x)
            r = self.__dict__.get("_mtp_tap")
            if r is not None:
                r.inputs.append(x)
                r.outputs.append(y)
                if len(r.inputs) > MAX_TAP_RECORDS:  # nobody reads them: keep memory bounded
                    del r.inputs[0], r.outputs[0]
            return y

        _TAP_CLASSES[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    norm.__class__ = _TAP_CLASSES[cls]
    rec = _TapRecord()
    norm.__dict__["_mtp_tap"] = rec
    return rec


def save_native_heads(
    layer: NativeMTPLayer, model: nn.Module, name: str, folder: str | Path, source: dict
) -> Path:
    """Write ``layer`` as a heads folder of architecture ``native-mtp-layer``
    (see :mod:`mlx_mtp.clp_format`; atomic, float32 or the layer's float dtype).

    Returns:
        The folder.
    """
    from .clp_format import NATIVE_LAYER, base_config, save_heads

    moe = any(".switch_mlp." in k for k, _ in tree_flatten(layer.parameters()))
    config = base_config(
        model,
        name,
        1,
        NATIVE_LAYER,
        moe=moe,
        mtp_layers=len(layer.layers),
        nextn=isinstance(layer, NextNLayer),
        source=source,
    )
    dtype = layer.fc.weight.dtype
    dtype = dtype if mx.issubdtype(dtype, mx.floating) else mx.float32
    return save_heads(SimpleNamespace(parameters=layer.parameters, config=config), folder, dtype)
