"""CLP heads, span predictor, gate baseline and their on-disk format.

Xie & Zhou, *CLP: Collocation-Length Prediction for Zero-Loss Adaptive
Multi-Token Inference* (arXiv 2606.10935), "backbone as architect" (docs/methods.md,
clp): the backbone's own LM head always writes token n+1; MTP head j
(j = 1..k) only ever writes token n+1+j. The paper publishes no head code, so
the head architecture and the file format below are this package's own.

Head architectures (``architecture`` in the config):

``resblock`` (trained by ``mlx-mtp train clp``)
    ``x_j = h_n + W2_j silu(W1_j [h_n; e_{n+1}])``, logits ``= lm_head(x_j)``:
    ``h_n`` is the backbone's final-norm hidden state at position n (what its
    LM head sees), ``e_{n+1}`` the input embedding of the backbone's own token
    n+1, ``W1_j`` (2D -> r) and ``W2_j`` (r -> D) a bottleneck of width r, and
    ``lm_head`` the backbone's frozen LM head. No norm after the residual.
    With ``depth`` d > 1 (config key, default 1) each head adds d - 1 blocks
    ``x <- x + V2 silu(V1 x)`` (D -> r -> D) after the first, weights
    ``blocks.{i}.*``.

``medusa`` (imported by ``mlx-mtp convert clp-heads`` from Medusa checkpoints)
    ``x = ResBlock^L(h_n)``, logits ``= W_out_j x`` with the head's own output
    projection (Medusa-1 layout); ``e_{n+1}`` is not used. Medusa head i
    (0-based) predicts n+2+i, i.e. it is our head j = i+1.

``native-mtp-layer`` (imported from a Qwen3.5 / Qwen3-Next checkpoint's ``mtp.*``)
    The checkpoint's whole MTP layer (:class:`mlx_mtp.native_mtp.NativeMTPLayer`,
    its own KV cache over the MTP positions), weights under its own names
    (norms already shifted, experts stacked), config keys ``moe`` and
    ``mtp_layers``. Run by ``--method mtp --opt heads=FOLDER``; the CLP method
    refuses it.

``native-mtp`` (imported from a MiMo checkpoint's ``model.mtp_layers.0``)
    ``x = input_proj([hidden_norm(h_n); token_norm(e_{n+1})])``, one dense
    decoder block whose self-attention sees only the current position (so it
    reduces to ``o_proj(v_proj(.))``), ``final_norm``, then the backbone's LM
    head. k = 1. See :mod:`mlx_mtp.converters.clp_import` for what is dropped.

Span predictor: exactly one ``nn.Linear(hidden_size, k + 1)`` on ``h_n``; class
c means "keep the first c head tokens" (0..k). Gate baseline: an MLP
``Linear(D, H) -> silu -> Linear(H, k + 1)`` of about 1M parameters, the kind
of gate the paper compares against.

On disk (a folder): ``config.json`` (:data:`FORMAT`, ``format_version``,
``base_model``, ``fingerprint`` of the base model's weights from
:func:`mlx_mtp.fingerprint.model_fingerprint`, ``hidden_size``,
``vocab_size``, ``k``, ``architecture`` and its sizes) and
``heads.safetensors`` (``heads.{j}.*`` for j = 0..k-1, ``predictor.*``,
optionally ``gate.*``). Loading checks the fingerprint and sizes and raises
:class:`~mlx_mtp.errors.CheckpointMismatchError` for any other base model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from huggingface_hub import snapshot_download
from mlx.utils import tree_flatten

from .artifacts import ASSETS as SHIPPED
from .artifacts import atomic_folder, find_artifact, search_dirs
from .dims import text_args
from .errors import CheckpointMismatchError, ModelLoadError, ModelNotFoundError
from .fingerprint import model_fingerprint, model_signature, same_model

FORMAT = "mlx-mtp-clp-heads"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "heads.safetensors"
ARCHITECTURES = ("resblock", "medusa", "native-mtp", "native-mtp-layer")
#: a checkpoint's full MTP layer with its own KV cache (Qwen3.5 / Qwen3-Next
#: ``mtp.*``, :mod:`mlx_mtp.native_mtp`): stored in this folder format, run by
#: ``--method mtp`` only (it is not a position-local CLP head)
NATIVE_LAYER = "native-mtp-layer"
#: folder of the heads shipped with the package (one sub-folder per base model)
ASSETS = SHIPPED / "clp"


# --------------------------------------------------------------------- heads
class _Block(nn.Module):
    """A residual branch ``V2 silu(V1 x)`` (d_in -> r -> D) whose output
    projection starts at zero, so ``x + branch`` starts as the identity."""

    def __init__(self, d_in: int, hidden: int, bottleneck: int):
        super().__init__()
        self.w1 = nn.Linear(d_in, bottleneck)
        self.w2 = nn.Linear(bottleneck, hidden)
        self.w2.weight = mx.zeros_like(self.w2.weight)
        self.w2.bias = mx.zeros_like(self.w2.bias)

    def branch(self, x: mx.array) -> mx.array:
        return self.w2(nn.silu(self.w1(x)))


class ResBlockHead(_Block):
    """One ``resblock`` head: ``x = h + W2 silu(W1 [h; e])`` (D -> D), then
    ``depth - 1`` blocks ``x <- x + V2 silu(V1 x)``. Every block starts as the
    identity, so an untrained head drafts what the LM head reads from ``h``.

    Args:
        hidden: D, the backbone's hidden size.
        bottleneck: r, width of each residual branch.
        depth: blocks per head (>= 1).

    Raises:
        ValueError: ``depth`` < 1.
    """

    def __init__(self, hidden: int, bottleneck: int, depth: int = 1):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        super().__init__(2 * hidden, hidden, bottleneck)  # the first block sees [h; e]
        self.blocks = [_Block(hidden, hidden, bottleneck) for _ in range(depth - 1)]

    def __call__(self, h: mx.array, e: mx.array) -> mx.array:
        x = h + self.branch(mx.concatenate([h, e.astype(h.dtype)], axis=-1))
        for b in self.blocks:
            x = x + b.branch(x)
        return x


class MedusaResBlock(nn.Module):
    """Medusa's ResBlock: ``x + silu(Linear(x))`` with bias."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class MedusaHead(nn.Module):
    """One Medusa-1 head: ``layers`` ResBlocks and its own output projection."""

    def __init__(self, hidden: int, vocab: int, layers: int):
        super().__init__()
        self.blocks = [MedusaResBlock(hidden) for _ in range(layers)]
        self.out = nn.Linear(hidden, vocab, bias=False)

    def __call__(self, h: mx.array, e: mx.array) -> mx.array:
        for b in self.blocks:
            h = b(h)
        return h


class NativeMTPHead(nn.Module):
    """MiMo-style native MTP layer with position-local attention (k = 1).

    ``x = input_proj([hidden_norm(h); token_norm(e)])``; ``x += o_proj(v_proj(
    input_norm(x)))``; ``x += down(silu(gate(y)) * up(y))`` with ``y =
    post_norm(x)``; returns ``final_norm(x)``.
    """

    def __init__(
        self, hidden: int, intermediate: int, eps: float, qkv_bias: bool, attention: int = 0
    ):
        super().__init__()
        attention = attention or hidden
        self.hidden_norm = nn.RMSNorm(hidden, eps=eps)
        self.token_norm = nn.RMSNorm(hidden, eps=eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_norm = nn.RMSNorm(hidden, eps=eps)
        self.v_proj = nn.Linear(hidden, attention, bias=qkv_bias)
        self.o_proj = nn.Linear(attention, hidden, bias=False)
        self.post_norm = nn.RMSNorm(hidden, eps=eps)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.final_norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, h: mx.array, e: mx.array) -> mx.array:
        x = self.input_proj(
            mx.concatenate([self.hidden_norm(h), self.token_norm(e.astype(h.dtype))], axis=-1)
        )
        x = x + self.o_proj(self.v_proj(self.input_norm(x)))
        y = self.post_norm(x)
        x = x + self.down_proj(nn.silu(self.gate_proj(y)) * self.up_proj(y))
        return self.final_norm(x)


class CLPHeads(nn.Module):
    """k MTP heads and the span predictor (and optionally the gate baseline).

    Args:
        config: the folder config (see module docstring); needs ``hidden_size``,
            ``k``, ``architecture`` and that architecture's sizes.

    Call :meth:`head_logits` with the backbone's final-norm hidden states and
    the embeddings of the backbone's own next tokens.
    """

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.config = dict(config)
        d, k = int(config["hidden_size"]), int(config["k"])
        arch = config["architecture"]
        if arch == "resblock":
            depth = int(config.get("depth", 1))
            self.heads = [ResBlockHead(d, int(config["bottleneck"]), depth) for _ in range(k)]
        elif arch == "medusa":
            self.heads = [
                MedusaHead(d, int(config["vocab_size"]), int(config["medusa_layers"]))
                for _ in range(k)
            ]
        elif arch == "native-mtp":
            self.heads = [
                NativeMTPHead(
                    d,
                    int(config["intermediate_size"]),
                    float(config.get("rms_norm_eps", 1e-6)),
                    bool(config.get("qkv_bias", True)),
                    int(config.get("attention_size", 0)),
                )
                for _ in range(k)
            ]
        elif arch == NATIVE_LAYER:
            raise ModelLoadError(
                "this heads folder holds a checkpoint's native MTP layer (architecture "
                f"{NATIVE_LAYER}, with its own KV cache), not CLP heads: use it with "
                "--method mtp --opt heads=FOLDER."
            )
        else:
            raise ModelLoadError(
                f"unknown CLP head architecture {arch!r}; known: {', '.join(ARCHITECTURES)}"
            )
        self.predictor = SpanPredictor(d, k)
        gate_hidden = config.get("gate_hidden")
        if gate_hidden:
            self.gate = GatePredictor(d, k, int(gate_hidden))

    @property
    def k(self) -> int:
        return len(self.heads)

    @property
    def own_output(self) -> bool:
        """True when heads carry their own output projection (Medusa)."""
        return self.config["architecture"] == "medusa"

    def head_states(self, h: mx.array, e: mx.array) -> mx.array:
        """Head outputs before the output projection.

        Args:
            h: (N, D) final-norm hidden states at positions n.
            e: (N, D) input embeddings of the backbone's tokens n+1.

        Returns:
            (k, N, D): row j is head j+1's state for token n+2+j.
        """
        return mx.stack([head(h, e) for head in self.heads])

    def head_logits(self, h: mx.array, e: mx.array, lm_head: Callable) -> mx.array:
        """Logits of every head: (k, N, V); head j+1 predicts token n+2+j."""
        x = self.head_states(h, e)
        if self.own_output:
            return mx.stack([head.out(x[j]) for j, head in enumerate(self.heads)])
        return lm_head(x)


class SpanPredictor(nn.Module):
    """CLP's span predictor: ONE linear layer, hidden_size -> k+1 classes
    (keep 0..k head tokens). Parameters: ``D * (k + 1) + (k + 1)``; 1,731 for
    SmolLM2 (D = 576) at k = 2."""

    def __init__(self, hidden: int, k: int):
        super().__init__()
        self.linear = nn.Linear(hidden, k + 1)

    def __call__(self, h: mx.array) -> mx.array:
        return self.linear(h)


class GatePredictor(nn.Module):
    """Gate baseline (the paper's ~1M-parameter gates): ``Linear(D, H) -> silu ->
    Linear(H, k+1)``. H = 1728 gives 1,002,243 parameters for D = 576, k = 2."""

    def __init__(self, hidden: int, k: int, gate_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, gate_hidden)
        self.fc2 = nn.Linear(gate_hidden, k + 1)

    def __call__(self, h: mx.array) -> mx.array:
        return self.fc2(nn.silu(self.fc1(h)))


def count_params(module: nn.Module) -> int:
    """Number of scalar parameters of a module."""
    return sum(v.size for _, v in tree_flatten(module.parameters()))


def gate_hidden_for(hidden: int, k: int, target: int = 1_000_000) -> int:
    """Gate width H whose gate has about ``target`` parameters."""
    return max(1, round((target - (k + 1)) / (hidden + 1 + k + 1)))


# -------------------------------------------------------------------- labels
def span_labels(head_tokens: Any, true_tokens: Any, valid: Any = None) -> Any:
    """Labels of the span predictor: the longest run of correct head predictions.

    For each position, count how many heads *in order* predict their token
    correctly: head 1 right, then head 2 right, ... stopping at the first miss.

    Args:
        head_tokens: (N, k) int array, head j's argmax at each position.
        true_tokens: (N, k) int array, the true tokens n+2 .. n+1+k.
        valid: optional (N, k) bool array; a target that does not exist (end
            of a sequence) counts as a miss.

    Returns:
        (N,) int array with values in 0..k (numpy in, numpy out).
    """
    ok = np.asarray(head_tokens) == np.asarray(true_tokens)
    if valid is not None:
        ok &= np.asarray(valid, dtype=bool)
    return np.cumprod(ok, axis=1).sum(axis=1).astype(np.int64)


# ------------------------------------------------------------------- on disk
def base_config(model: nn.Module, name: str, k: int, architecture: str, **sizes: Any) -> dict:
    """Config of heads made for ``model`` (fingerprint, signature, hidden size,
    vocab size)."""
    args = text_args(model)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "base_model": name,
        "fingerprint": model_fingerprint(model),
        "signature": model_signature(model),
        "model_type": getattr(model, "model_type", ""),
        "hidden_size": int(args.hidden_size),
        "vocab_size": int(args.vocab_size),
        "k": int(k),
        "architecture": architecture,
        **sizes,
    }


def save_heads(heads: CLPHeads, folder: str | Path, dtype: mx.Dtype = mx.float16) -> Path:
    """Write heads atomically (:func:`~mlx_mtp.artifacts.atomic_folder`): an
    existing ``folder`` is replaced only after the new one is complete.

    Raises:
        OSError: the folder cannot be written (a full disk; nothing changed).
    """
    with atomic_folder(Path(folder)) as tmp:
        weights = {k: v.astype(dtype) for k, v in tree_flatten(heads.parameters())}
        mx.save_safetensors(str(tmp / WEIGHTS_FILE), weights, metadata={"format": FORMAT})
        (tmp / CONFIG_FILE).write_text(json.dumps(heads.config, indent=2) + "\n")
    return Path(folder)


def read_heads(folder: str | Path) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """Read and validate a heads folder without a model.

    Returns:
        (config, weights).

    Raises:
        ModelLoadError: missing files, wrong format, or weights that do not
            match the config's architecture and sizes.
    """
    folder = Path(folder)
    cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise ModelLoadError(
            f"{folder} is not a CLP heads folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}). "
            "Train heads with `mlx-mtp train clp` or import them with "
            "`mlx-mtp convert clp-heads`."
        )
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON ({e})") from e
    if config.get("format") != FORMAT:
        raise ModelLoadError(f"{cfg_path}: format is {config.get('format')!r}, not {FORMAT!r}")
    if int(config.get("format_version", 0)) > FORMAT_VERSION:
        raise ModelLoadError(
            f"{cfg_path}: format version {config.get('format_version')} is newer than this "
            f"mlx-mtp understands ({FORMAT_VERSION}); upgrade mlx-mtp."
        )
    for key in ("fingerprint", "hidden_size", "k", "architecture", "vocab_size"):
        if key not in config:
            raise ModelLoadError(f"{cfg_path} lacks {key!r}")
    try:
        weights = mx.load(str(w_path))
    except Exception as e:
        raise ModelLoadError(f"{w_path} cannot be read ({type(e).__name__}: {e})") from e
    if config["architecture"] == NATIVE_LAYER:  # checked against the model when loaded
        return config, weights
    # check names and shapes against a freshly built module
    try:
        ref = dict(tree_flatten(CLPHeads(config).parameters()))
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{cfg_path}: incomplete architecture settings ({e})") from e
    missing = sorted(set(ref) - set(weights) - {n for n in ref if n.startswith("gate.")})
    extra = sorted(set(weights) - set(ref))
    if missing or extra:
        raise ModelLoadError(
            f"{w_path} does not match its config: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for n, w in weights.items():
        if w.shape != ref[n].shape:
            raise ModelLoadError(
                f"{w_path}: {n} has shape {tuple(w.shape)}, config implies {tuple(ref[n].shape)}"
            )
    return config, weights


def check_compatible(config: dict[str, Any], model: nn.Module, where: str = "") -> None:
    """Refuse heads made for another base model.

    Raises:
        CheckpointMismatchError: hidden size, vocabulary or weights
            (:func:`~mlx_mtp.fingerprint.same_model`: fingerprint, else
            signature) differ from ``model``'s.
    """
    args = text_args(model)
    what = f"CLP heads{f' in {where}' if where else ''} were made for {config.get('base_model')!r}"
    if int(config["hidden_size"]) != int(args.hidden_size):
        raise CheckpointMismatchError(
            f"{what} (hidden size {config['hidden_size']}), but this model has hidden size "
            f"{args.hidden_size}. Train heads for this model with `mlx-mtp train clp --model ...`."
        )
    if int(config["vocab_size"]) != int(args.vocab_size):
        raise CheckpointMismatchError(
            f"{what} (vocabulary {config['vocab_size']}), but this model has {args.vocab_size} "
            "tokens. Train heads for this model with `mlx-mtp train clp --model ...`."
        )
    if not same_model(model, config["fingerprint"], config.get("signature")):
        fp = model_fingerprint(model)
        raise CheckpointMismatchError(
            f"{what} (weights fingerprint {config['fingerprint']}), but this model's weights "
            f"have fingerprint {fp}: it is a different model or fine-tune. Train heads for it "
            "with `mlx-mtp train clp --model ...`."
        )


def load_heads(folder: str | Path, model: nn.Module, dtype: mx.Dtype | None = None) -> CLPHeads:
    """Load a heads folder for ``model`` (checked with :func:`check_compatible`).

    Args:
        folder: a heads folder.
        model: the base model the heads must belong to.
        dtype: compute dtype of the heads (default: the model's embedding dtype,
            float32 if that is quantized).

    Raises:
        ModelLoadError: not a valid heads folder.
        CheckpointMismatchError: heads made for another base model.
    """
    config, weights = read_heads(folder)
    check_compatible(config, model, str(folder))
    if "gate.fc1.weight" not in weights:
        config.pop("gate_hidden", None)
    heads = CLPHeads(config)
    if dtype is None:
        w = model.model.embed_tokens.weight
        dtype = w.dtype if mx.issubdtype(w.dtype, mx.floating) else mx.float32
    heads.load_weights([(n, w.astype(dtype)) for n, w in weights.items()], strict=True)
    heads.eval()
    mx.eval(heads.parameters())
    return heads


def find_heads(model: nn.Module, search: list[Path] | None = None) -> Path | None:
    """The first heads folder made for ``model`` (same fingerprint, or for
    heads with a signature, the same weights at another precision:
    :func:`~mlx_mtp.fingerprint.same_model`): first the user's trained heads
    (``$MLX_MTP_HOME/clp/*``), then the shipped ones (``mlx_mtp/assets/clp/*``).
    None when there is none."""

    def heads(cfg: Path, c: dict[str, Any]) -> bool:  # (a native MTP layer is no CLP head)
        return c.get("architecture") != NATIVE_LAYER and (cfg.parent / WEIGHTS_FILE).is_file()

    roots = search if search is not None else search_dirs("clp")
    return find_artifact(model, roots, f"*/{CONFIG_FILE}", accept=heads)


def heads_for(model: nn.Module, spec: str | None, name: str) -> tuple[CLPHeads, Path]:
    """The CLP heads ``model`` runs with and their folder: ``spec`` (a
    folder or hub repo id), else the user's or the shipped heads made for
    it (:func:`find_heads`).

    Args:
        model: the base model.
        spec: a heads folder or hub repo id, or None.
        name: the model's name, for the error.

    Raises:
        ModelNotFoundError: no heads for this model (saying how to make
            some), or ``spec`` cannot be found.
        ModelLoadError, CheckpointMismatchError: see :func:`load_heads`.
    """
    if spec:
        folder = resolve_heads(spec)
    else:
        folder = find_heads(model)
        if folder is None:
            raise ModelNotFoundError(
                f"--method clp: no CLP heads for {name}. Train them with "
                f"`mlx-mtp train clp --model {name} --data prompts.jsonl`, import them with "
                "`mlx-mtp convert clp-heads`, or pass --opt heads=FOLDER."
            )
    return load_heads(folder, model), folder


def resolve_heads(spec: str | Path) -> Path:
    """A local heads folder for ``spec``: an existing folder, or a Hugging Face
    repo id (``org/name``) downloaded with ``huggingface_hub`` (config and
    safetensors files only).

    Raises:
        ModelNotFoundError: no such folder, or the repo cannot be downloaded.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    s = str(spec)
    if path.exists() or s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise ModelNotFoundError(
            f"CLP heads {s!r}: not a folder and not a Hugging Face repo id (org/name)."
        )

    try:
        return Path(snapshot_download(s, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # offline, 404, gated, ...
        raise ModelNotFoundError(
            f"Could not get CLP heads {s!r} from the Hugging Face hub ({type(e).__name__}). "
            "If you are offline, download the repo elsewhere and pass the local folder."
        ) from e
