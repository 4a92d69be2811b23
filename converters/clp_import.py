"""Import CLP heads: this package's own format, Medusa heads, MiMo native MTP.

``mlx-mtp convert clp-heads SRC DST --model M`` writes a heads folder (see
:mod:`mlx_mtp.clp_format`) stamped with the fingerprint of base model M. Every
source is checked against M's hidden size and vocabulary; the write is atomic
(:func:`mlx_mtp.artifacts.atomic_folder`) and never replaces an existing DST
unless ``overwrite``; a truncated or corrupt source file is one
:class:`HeadConversionError`.

What is mapped, exactly:

``clp`` (a folder or hub repo in this package's format)
    Validated (format, version, names and shapes), checked against M
    (fingerprint, hidden size, vocabulary: a mismatch raises
    :class:`CheckpointMismatchError`) and copied unchanged.

``medusa`` (``medusa_lm_head.safetensors`` [+ ``config.json``], Medusa-1)
    Key ``{i}.{j}.linear.weight/bias`` (ResBlock j of head i, D x D) ->
    ``heads.{i}.blocks.{j}.linear.*``; ``{i}.{L}.weight`` (head i's own LM
    head, V x D) -> ``heads.{i}.out.weight``. Medusa head i predicts token
    n+2+i from the base model's last hidden state, i.e. it is CLP head i+1 and
    already obeys backbone-as-architect (architecture ``medusa``). Medusa has
    no span predictor: the imported one keeps all k tokens (weights 0, bias
    one-hot at class k; ``predictor_trained: false``). Refused: ``.pt`` files,
    heads of different depths, sizes that do not fit M.

``mimo-mtp`` (a MiMo checkpoint folder: ``config.json`` + safetensors with
``model.mtp_layers.{i}.*``, the tensors mlx-lm drops when it loads MiMo)
    Layer 0 only, as one head (k = 1, architecture ``native-mtp``):
    ``hidden_layernorm`` -> ``hidden_norm``, ``token_layernorm`` ->
    ``token_norm``, ``input_proj`` (D x 2D; input order [hidden; embedding],
    the reverse of DeepSeek-V3's ``eh_proj``) -> ``input_proj``,
    ``input_layernorm`` -> ``input_norm``, ``self_attn.v_proj`` (rows repeated
    per query head for GQA) -> ``v_proj``, ``self_attn.o_proj`` ->
    ``o_proj``, ``post_attention_layernorm`` -> ``post_norm``, ``mlp.*`` ->
    ``gate_proj``/``up_proj``/``down_proj``, ``final_layernorm`` ->
    ``final_norm``; the base model's LM head is used. Approximation, stated
    plainly: the layer's self-attention runs over the current position only
    (no KV cache of earlier MTP positions), so softmax is 1 and ``q_proj`` /
    ``k_proj`` are dropped; its predictions therefore differ from the original
    MTP layer's, and the hidden state fed in is the final-norm one (as vLLM and
    SGLang feed it). Verified mode stays exact whatever the heads predict.
    Refused: checkpoints without ``model.mtp_layers.0``, FP8/quantized MTP
    tensors (``*_scale*``), an embedding that does not match M's. Dropped and
    reported: MTP layers beyond the first (they chain on layer 0's output).
    DeepSeek-V3 and Qwen3-Next / Qwen3.5 MTP layers are mapped whole (below).

``qwen3-mtp`` (a Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint folder with ``mtp.*``
tensors, which mlx-lm drops)
    The whole MTP layer, exactly (:mod:`mlx_mtp.native_mtp`: fc, the two
    pre-fc norms, one full-attention decoder block with its dense or MoE MLP,
    the final norm; norms shifted and experts stacked as mlx-lm does for the
    backbone), written as a heads folder of architecture ``native-mtp-layer``
    for ``--method mtp --opt heads=DST``. M must be that checkpoint's model
    (same model type, hidden size and vocabulary; the fingerprint is M's).

``deepseek-nextn`` (a DeepSeek-V3 checkpoint folder with its nextn layer
``model.layers.{num_hidden_layers}.*``, which mlx-lm drops)
    The whole nextn layer (enorm, hnorm, eh_proj, the MLA + MoE decoder block,
    shared_head.norm), as ``qwen3-mtp``: a ``native-mtp-layer`` heads folder
    marked ``nextn`` for ``--method mtp --opt heads=DST``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_mtp.artifacts import atomic_folder
from mlx_mtp.clp_format import (
    CONFIG_FILE,
    FORMAT,
    WEIGHTS_FILE,
    CLPHeads,
    base_config,
    check_compatible,
    read_heads,
    resolve_heads,
    save_heads,
)
from mlx_mtp.errors import CheckpointMismatchError, MTPError
from mlx_mtp.loading import one_line
from mlx_mtp.native_mtp import NEXTN_FAMILIES, find_mtp_tensors, find_nextn_tensors

SOURCES = ("auto", "clp", "medusa", "mimo-mtp", "qwen3-mtp", "deepseek-nextn")
MEDUSA_FILE = "medusa_lm_head.safetensors"


class HeadConversionError(MTPError):
    """A heads source that cannot be imported (unknown layout, unsupported
    tensors, sizes that do not fit the base model)."""


def detect(folder: Path) -> str:
    """Which source layout ``folder`` has: ``clp``, ``medusa`` or ``mimo-mtp``.

    Raises:
        HeadConversionError: none of them.
    """
    cfg = folder / CONFIG_FILE
    if (folder / WEIGHTS_FILE).is_file() and cfg.is_file():
        try:
            if json.loads(cfg.read_text()).get("format") == FORMAT:
                return "clp"
        except json.JSONDecodeError:
            pass
    if (folder / MEDUSA_FILE).is_file():
        return "medusa"
    if (folder / "medusa_lm_head.pt").is_file():
        raise HeadConversionError(
            f"{folder} has Medusa heads only as medusa_lm_head.pt (a pickle); convert them to "
            "medusa_lm_head.safetensors first (pickles are not loaded, for safety)."
        )
    if cfg.is_file() and any(k.startswith("model.mtp_layers.") for k in _tensor_names(folder)):
        return "mimo-mtp"
    if cfg.is_file() and find_mtp_tensors(folder):
        return "qwen3-mtp"
    if cfg.is_file() and _has_nextn(folder, cfg):
        return "deepseek-nextn"
    raise HeadConversionError(
        f"{folder}: not CLP heads ({CONFIG_FILE} + {WEIGHTS_FILE}), not Medusa heads "
        f"({MEDUSA_FILE}), not a MiMo checkpoint with model.mtp_layers.* tensors and not a "
        "Qwen3.5 / Qwen3-Next checkpoint with mtp.* tensors nor a DeepSeek-V3 checkpoint with "
        "a nextn layer."
    )


def check_source(
    src: str | Path, dst: str | Path, source: str = "auto", overwrite: bool = False
) -> tuple[Path, str]:
    """Everything about a conversion that needs no base model: the ``--from``
    name, ``dst`` (free unless ``overwrite``), and the source heads folder and
    its layout. Run before the base model loads, so that a bad source or
    destination is refused before anything is loaded or written.

    Returns:
        (the local source folder, its layout: ``clp``, ``medusa``, ...).

    Raises:
        HeadConversionError, FileExistsError, ModelNotFoundError: see :func:`convert`.
    """
    if source not in SOURCES:
        raise HeadConversionError(f"--from must be one of {', '.join(SOURCES)}, got {source!r}")
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists; pass --overwrite to replace it.")
    folder = resolve_heads(src)
    return folder, detect(folder) if source == "auto" else source


def convert(
    src: str | Path,
    dst: str | Path,
    loaded: Any,
    source: str = "auto",
    overwrite: bool = False,
) -> str:
    """Convert heads at ``src`` for base model ``loaded`` into the folder ``dst``.

    Args:
        src: folder (or hub repo id ``org/name``) of the source heads.
        dst: output heads folder.
        loaded: :class:`mlx_mtp.loading.LoadedModel` of the base model.
        source: ``auto`` (detect), ``clp``, ``medusa`` or ``mimo-mtp``.
        overwrite: replace an existing ``dst``.

    Returns:
        A one-paragraph summary of what was mapped and dropped.

    Raises:
        FileExistsError: ``dst`` exists and not ``overwrite``.
        HeadConversionError, CheckpointMismatchError, ModelLoadError,
        ModelNotFoundError: see the module docstring.
    """
    folder, kind = check_source(src, dst, source, overwrite)
    dst = Path(dst)
    if kind == "clp":
        config, _ = read_heads(folder)
        check_compatible(config, loaded.model, str(folder))
        with atomic_folder(dst) as tmp:
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                shutil.copyfile(folder / name, tmp / name)
        return f"copied CLP heads ({config['architecture']}, k={config['k']}) to {dst}"
    if kind in ("qwen3-mtp", "deepseek-nextn"):
        return _from_native_mtp(folder, dst, loaded, kind)
    if kind == "medusa":
        heads, note = _from_medusa(folder, loaded)
    else:
        heads, note = _from_mimo(folder, loaded)
    save_heads(heads, dst, dtype=mx.float16)
    return f"{note}; written to {dst}"


def _keep_all_predictor(heads: CLPHeads) -> None:
    """Span predictor that always keeps all k head tokens (no labels to train on)."""
    w = heads.predictor.linear
    bias = np.zeros(w.bias.shape[0], dtype=np.float32)
    bias[-1] = 1.0
    w.weight = mx.zeros_like(w.weight)
    w.bias = mx.array(bias)


def _check_sizes(what: str, d: int, v: int | None, model: Any) -> None:
    from mlx_mtp.native_mtp import text_args

    args = text_args(model)
    if d != args.hidden_size or (v is not None and v != args.vocab_size):
        raise CheckpointMismatchError(
            f"{what} have hidden size {d}"
            + (f" and vocabulary {v}" if v is not None else "")
            + f", but the base model has {args.hidden_size} and {args.vocab_size}: they were "
            "made for another model. Pass the right --model."
        )


# -------------------------------------------------------------------- medusa
def _from_medusa(folder: Path, loaded: Any) -> tuple[CLPHeads, str]:
    w = _load(folder / MEDUSA_FILE)
    heads_idx: dict[int, dict[str, mx.array]] = {}
    for key, val in w.items():
        i, _, rest = key.partition(".")
        if not i.isdigit():
            raise HeadConversionError(f"{MEDUSA_FILE}: unexpected tensor {key!r} (not Medusa-1)")
        heads_idx.setdefault(int(i), {})[rest] = val
    k = len(heads_idx)
    if k == 0 or sorted(heads_idx) != list(range(k)):
        raise HeadConversionError(f"{MEDUSA_FILE}: heads are not numbered 0..k-1")
    depths = set()
    for i, t in heads_idx.items():
        blocks = sorted({int(n.split(".")[0]) for n in t if n.endswith("linear.weight")})
        depth = len(blocks)
        if f"{depth}.weight" not in t or blocks != list(range(depth)):
            raise HeadConversionError(
                f"{MEDUSA_FILE}: head {i} lacks ResBlocks 0..L-1 followed by its LM head "
                f"'{i}.L.weight' (tensors: {sorted(t)[:6]})"
            )
        depths.add(depth)
    if len(depths) != 1:
        raise HeadConversionError(f"{MEDUSA_FILE}: heads of different depths {sorted(depths)}")
    depth = depths.pop()
    v, d = heads_idx[0][f"{depth}.weight"].shape
    _check_sizes("These Medusa heads", d, v, loaded.model)
    mcfg = {}
    if (folder / CONFIG_FILE).is_file():
        mcfg = json.loads((folder / CONFIG_FILE).read_text())
        n = mcfg.get("medusa_num_heads")
        if n is not None and int(n) != k:
            raise HeadConversionError(f"config says medusa_num_heads={n}, file has {k} heads")
    config = base_config(
        loaded.model,
        loaded.name,
        k,
        "medusa",
        medusa_layers=depth,
        predictor_trained=False,
        source={"kind": "medusa", "base_model": mcfg.get("base_model_name_or_path")},
    )
    heads = CLPHeads(config)
    weights = []
    for i, t in heads_idx.items():
        for j in range(depth):
            weights.append((f"heads.{i}.blocks.{j}.linear.weight", t[f"{j}.linear.weight"]))
            weights.append((f"heads.{i}.blocks.{j}.linear.bias", t[f"{j}.linear.bias"]))
        weights.append((f"heads.{i}.out.weight", t[f"{depth}.weight"]))
    heads.load_weights(
        [(n, a.astype(mx.float32)) for n, a in weights] + _predictor_weights(heads), strict=True
    )
    _keep_all_predictor(heads)
    note = (
        f"Medusa: {k} head(s) x {depth} ResBlock(s) + own LM head mapped to CLP heads 1..{k}; "
        "span predictor untrained (keeps all k)"
    )
    return heads, note


def _predictor_weights(heads: CLPHeads) -> list[tuple[str, mx.array]]:
    return [
        ("predictor.linear.weight", heads.predictor.linear.weight),
        ("predictor.linear.bias", heads.predictor.linear.bias),
    ]


# ---------------------------------------------------------------------- mimo
def _tensor_names(folder: Path) -> list[str]:
    idx = folder / "model.safetensors.index.json"
    if idx.is_file():
        return list(json.loads(idx.read_text()).get("weight_map", {}))
    return [n for f in sorted(folder.glob("*.safetensors")) for n in _load(f, names=True)]


def _load(path: Path, names: bool = False) -> Any:
    """``mx.load`` of a safetensors file or (``names``) its tensor names, read
    from the JSON header alone (whatever the dtypes; MLX cannot load some).

    Raises:
        HeadConversionError: a truncated or corrupt file (MLX's RuntimeError
            names no file).
    """
    try:
        if not names:
            return mx.load(str(path))
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return [k for k in json.loads(f.read(n)) if k != "__metadata__"]
    except (RuntimeError, ValueError) as e:
        raise HeadConversionError(
            f"{path} cannot be read ({one_line(e)}): the file is truncated or corrupt; "
            "download it again."
        ) from e


def _read_tensors(folder: Path, prefix: str) -> dict[str, mx.array]:
    """Tensors whose name starts with ``prefix``, reading only the shards that hold them."""
    idx = folder / "model.safetensors.index.json"
    if idx.is_file():
        wm = json.loads(idx.read_text())["weight_map"]
        files = sorted({folder / f for k, f in wm.items() if k.startswith(prefix)})
    else:
        files = [f for f in sorted(folder.glob("*.safetensors")) if f.name != MEDUSA_FILE]
    out = {}
    for f in files:
        out.update({k: v for k, v in _load(f).items() if k.startswith(prefix)})
    return out


def _embedding_fingerprint_matches(folder: Path, cfg: dict, model: Any) -> bool:
    """The checkpoint's embedding is ``model``'s, at any precision (fingerprint,
    else signature: a bf16 checkpoint and the 4-bit model the user runs)."""
    from mlx_mtp.fingerprint import model_fingerprint, model_signature, same_model

    emb = _read_tensors(folder, "model.embed_tokens.weight").get("model.embed_tokens.weight")
    if emb is None:
        return True  # nothing to compare with
    fake = SimpleNamespace(
        model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=emb)),
        layers=[None] * int(cfg["num_hidden_layers"]),
    )
    return same_model(model, model_fingerprint(fake), model_signature(fake))


def _from_mimo(folder: Path, loaded: Any) -> tuple[CLPHeads, str]:
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    names = _tensor_names(folder)
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.mtp_layers.")})
    if 0 not in layers:
        raise HeadConversionError(f"{folder}: no model.mtp_layers.0.* tensors to import")
    p = "model.mtp_layers.0."
    t = _read_tensors(folder, p)
    t = {k[len(p) :]: v for k, v in t.items()}
    quant = [k for k in t if "scale" in k or t[k].dtype in (mx.uint8, mx.uint32, mx.int8)]
    if quant:
        raise HeadConversionError(
            f"{folder}: the MTP layer is quantized ({quant[:3]}); convert a bf16/fp16 checkpoint."
        )
    need = [
        "hidden_layernorm.weight",
        "token_layernorm.weight",
        "input_proj.weight",
        "input_layernorm.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "final_layernorm.weight",
    ]
    missing = [n for n in need if n not in t]
    if missing:
        raise HeadConversionError(f"{folder}: MiMo MTP layer 0 lacks {missing}")
    d = int(cfg["hidden_size"])
    _check_sizes("This checkpoint's MTP layer and model", d, int(cfg["vocab_size"]), loaded.model)
    if not _embedding_fingerprint_matches(folder, cfg, loaded.model):
        raise CheckpointMismatchError(
            f"{folder}: its embedding does not match the base model's; the MTP layer belongs "
            "to another model. Pass that model with --model."
        )
    n_heads, n_kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or d // n_heads)
    rep = n_heads // n_kv

    def expand(a: mx.array) -> mx.array:  # GQA: query head q reads kv head q // rep
        a = np.array(a.astype(mx.float32))
        a = a.reshape(n_kv, head_dim, *a.shape[1:])
        return mx.array(np.repeat(a, rep, axis=0).reshape(n_heads * head_dim, *a.shape[2:]))

    qkv_bias = "self_attn.v_proj.bias" in t
    config = base_config(
        loaded.model,
        loaded.name,
        1,
        "native-mtp",
        intermediate_size=int(t["mlp.gate_proj.weight"].shape[0]),
        attention_size=n_heads * head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        predictor_trained=False,
        source={"kind": "mimo-mtp", "model_type": cfg.get("model_type"), "layer": 0},
    )
    heads = CLPHeads(config)
    m = {
        "hidden_norm.weight": t["hidden_layernorm.weight"],
        "token_norm.weight": t["token_layernorm.weight"],
        "input_proj.weight": t["input_proj.weight"],
        "input_norm.weight": t["input_layernorm.weight"],
        "v_proj.weight": expand(t["self_attn.v_proj.weight"]),
        "o_proj.weight": t["self_attn.o_proj.weight"],
        "post_norm.weight": t["post_attention_layernorm.weight"],
        "gate_proj.weight": t["mlp.gate_proj.weight"],
        "up_proj.weight": t["mlp.up_proj.weight"],
        "down_proj.weight": t["mlp.down_proj.weight"],
        "final_norm.weight": t["final_layernorm.weight"],
    }
    if qkv_bias:
        m["v_proj.bias"] = expand(t["self_attn.v_proj.bias"])
    heads.load_weights(
        [(f"heads.0.{n}", a.astype(mx.float32)) for n, a in m.items()] + _predictor_weights(heads),
        strict=True,
    )
    _keep_all_predictor(heads)
    dropped = [f"model.mtp_layers.{i}" for i in layers if i != 0]
    note = (
        "MiMo MTP layer 0 mapped to one native-mtp head (k=1; attention over the current "
        "position only, q_proj/k_proj dropped); span predictor untrained (keeps the token)"
        + (f"; dropped {', '.join(dropped)}" if dropped else "")
    )
    return heads, note


# ---------------------------------------------------------------- qwen3 mtp
def _has_nextn(folder: Path, cfg: Path) -> bool:
    """A DeepSeek-V3 checkpoint whose nextn layer is stored
    (``model.layers.{num_hidden_layers}.*``)."""
    try:
        c = json.loads(cfg.read_text())
    except json.JSONDecodeError:
        return False
    if c.get("model_type") not in NEXTN_FAMILIES or "num_hidden_layers" not in c:
        return False
    return bool(find_nextn_tensors(folder, int(c["num_hidden_layers"])))


def _from_native_mtp(folder: Path, dst: Path, loaded: Any, kind: str) -> str:
    from mlx_mtp.native_mtp import load_native_mtp, save_native_heads, text_args

    cfg = json.loads((folder / CONFIG_FILE).read_text())
    text = cfg.get("text_config", cfg)
    _check_sizes(
        "This checkpoint's MTP layer and model",
        int(text["hidden_size"]),
        int(text["vocab_size"]),
        loaded.model,
    )
    if cfg.get("model_type") != getattr(loaded.model, "model_type", None):
        raise CheckpointMismatchError(
            f"{folder} is a {cfg.get('model_type')} checkpoint but --model is a "
            f"{getattr(loaded.model, 'model_type', '?')} model: pass the checkpoint's own model."
        )
    layer = load_native_mtp(folder, loaded.model, cfg)
    n = len(layer.layers)
    save_native_heads(
        layer,
        loaded.model,
        loaded.name,
        dst,
        {"kind": kind, "model_type": cfg.get("model_type"), "layers": n},
    )
    args = text_args(loaded.model)
    moe = (
        "MoE"
        if getattr(args, "num_experts", 0) or getattr(args, "n_routed_experts", 0)
        else "dense"
    )
    what = "nextn" if kind == "deepseek-nextn" else "native MTP"
    return (
        f"{cfg.get('model_type')} {what} layer ({n} block, {moe}; its own KV cache) written "
        f"to {dst} as a native-mtp-layer heads folder; use it with --method mtp --opt heads={dst}"
    )
