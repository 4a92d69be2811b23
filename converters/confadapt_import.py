"""Import a self-distilled MTP checkpoint into an MLX model folder for ``confadapt``.

Kirchenbauer et al., *Multi-Token Prediction via Self-Distillation* (arXiv
2602.06019; docs/methods.md, confadapt) release plain ``Qwen3ForCausalLM`` /
``LlamaForCausalLM`` checkpoints (``jwkirchenbauer/Qwen3-4B-Inst-2507-MTP``,
``jwkirchenbauer/L3-1-8B-Magpie-MTP``): sharded bf16 safetensors with an index,
and a tokenizer with one added mask token ``<|mtp_special_token_0|>``.

The conversion is mlx-lm's own (``mlx_lm.utils.load_model`` / ``quantize_model``
/ ``save_config``) and stays lazy like ``mlx_lm.convert``: no parameter is
evaluated before its output shard is written, so peak memory is about one
output shard (:data:`MAX_SHARD_BYTES`), not the whole model (an 8B bf16
checkpoint evaluated up front needed about 16 GB). The shards are written by
:func:`save_sharded` (mlx-lm's ``save_model`` layout, plus a progress bar and a
shard size that can be set). This module adds the checks, the MTP
metadata file (:data:`~mlx_mtp.confadapt_format.MTP_CONFIG`: mask token id
looked up in the tokenizer, EOS ids, prompt format, default k) and the prompt
format: ``plain`` (BOS + input + "\\n\\n", the Qwen checkpoint's format, which
becomes the folder's chat template; the original one is kept in the metadata)
or ``chat`` (the checkpoint's own chat template).

Atomic (:func:`mlx_mtp.artifacts.atomic_folder`): everything is written into
a temporary sibling folder, ``config.json`` last, then the folder is moved
into place. An interrupted or failed conversion (a full disk: ``OSError``)
leaves no folder that loads as a model. An existing destination is never
replaced unless ``overwrite``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mlx_mtp.artifacts import atomic_folder, mlx_write_errors
from mlx_mtp.confadapt_format import (
    MASK_TOKEN,
    MTP_CONFIG,
    PROMPT_FORMATS,
    MissingMaskTokenError,
    MTPMetadata,
    no_mask_token_message,
    tokenizer_eos_ids,
    tokenizer_mask_id,
)
from mlx_mtp.errors import (
    CheckpointMismatchError,
    InvalidArgumentError,
    UnsupportedModelError,
)
from mlx_mtp.families import TREE_FAMILIES
from mlx_mtp.loading import one_line

#: model types whose checkpoints confadapt can decode: the llama-style families
#: of the tree forward pass (listed once, in :data:`mlx_mtp.families.TREE_FAMILIES`)
SUPPORTED_MODEL_TYPES = TREE_FAMILIES

#: largest output shard (bytes); mlx-lm's ``save_model`` uses 5 GB
MAX_SHARD_BYTES = 5 << 30

#: chat template of the ``plain`` prompt format: BOS + each message + "\n\n"
PLAIN_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% for message in messages %}{{ message['content'] }}\n\n{% endfor %}"
)


class MTPCheckpointError(CheckpointMismatchError):
    """A checkpoint folder that is incomplete, corrupt or not an MTP checkpoint."""


def default_prompt_format(model_type: str) -> str:
    """``plain`` for Qwen3 checkpoints (the paper's format), ``chat`` otherwise."""
    return "plain" if model_type == "qwen3" else "chat"


def check_shards(src: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, checked against its index.

    Raises:
        MTPCheckpointError: no weights, a shard listed in the index is missing,
            or the index is not valid JSON.
    """
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MTPCheckpointError(f"{index} is not a valid safetensors index ({e}).") from e
        shards = sorted({src / f for f in weight_map.values()})
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise MTPCheckpointError(
                f"{src} is incomplete: shard(s) {', '.join(missing)} listed in "
                f"{index.name} are missing. Download the checkpoint again."
            )
        return shards
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise MTPCheckpointError(f"{src} has no .safetensors weights.")
    return shards


def convert_mtp_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    quantize: int | None = None,
    group_size: int = 64,
    dtype: str | None = None,
    prompt_format: str | None = None,
    k: int = 16,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool = False,
) -> Path:
    """Convert a self-distilled MTP checkpoint into an MLX folder with MTP metadata.

    Args:
        src: a Hugging Face repo id (downloaded with ``huggingface_hub``), an
            alias, or a local folder laid out like the released repos.
        dst: the folder to create.
        quantize: None (keep float weights), 4 or 8 bits (affine, ``group_size``).
        dtype: cast float weights (``bfloat16``, ``float16``, ``float32``);
            default: as stored.
        prompt_format: ``plain`` or ``chat``; default by model type
            (:func:`default_prompt_format`).
        k: default block size recorded in the metadata.
        overwrite: replace an existing ``dst``.
        max_shard_bytes: largest output shard; peak memory of the conversion
            is about one shard plus the largest single tensor.
        progress: show a progress bar (bytes written) on stderr.

    Returns:
        ``dst``.

    Raises:
        InvalidArgumentError: ``dst`` exists and not ``overwrite``; bad options.
        ModelNotFoundError: ``src`` is neither a folder nor a reachable repo.
        MissingMaskTokenError: the tokenizer has no ``<|mtp_special_token_0|>``.
        UnsupportedModelError: not a llama/qwen-style causal LM.
        MTPCheckpointError: missing or corrupt shards, mask id outside the vocabulary.
    """
    from mlx_lm.utils import load_tokenizer, quantize_model, save_config

    from mlx_mtp.loading import resolve_model

    dst = Path(dst).expanduser()
    if quantize not in (None, 4, 8):
        raise InvalidArgumentError(f"--quantize must be 4 or 8 bits, got {quantize}.")
    if prompt_format is not None and prompt_format not in PROMPT_FORMATS:
        raise InvalidArgumentError(f"--prompt-format must be plain or chat, got {prompt_format!r}.")
    if dst.exists() and not overwrite:
        raise InvalidArgumentError(
            f"{dst} already exists; choose another destination or pass --overwrite."
        )
    path = resolve_model(str(src))
    config = _read_config(path)
    mtype = config.get("model_type", "?")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{src}: model type {mtype!r} is not supported by confadapt (supported: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))})."
        )
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:
        raise MTPCheckpointError(
            f"{src}: cannot read the tokenizer ({type(e).__name__}: {e})."
        ) from e
    mask_id = tokenizer_mask_id(tokenizer)
    if mask_id is None:
        raise MissingMaskTokenError(no_mask_token_message(f"The checkpoint {src}"))
    vocab = int(config.get("vocab_size", 0))
    if not 0 <= mask_id < vocab:
        raise MTPCheckpointError(
            f"{src}: the mask token id {mask_id} is outside the model's vocabulary ({vocab} "
            "rows); the checkpoint does not match its tokenizer."
        )
    check_shards(path)
    fmt = prompt_format or default_prompt_format(mtype)

    with atomic_folder(dst) as tmp:
        model, config = _load_weights(path, dtype)
        if quantize:
            model, config = quantize_model(model, config, group_size, quantize)
        try:
            save_sharded(tmp, model, max_shard_bytes=max_shard_bytes, progress=progress)
        except Exception as e:  # a lazy source shard failed to load while being written
            if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
                raise  # the output folder: disk full, permissions
            raise _corrupt(path, e) from e
        original_template = getattr(tokenizer, "chat_template", None)
        if fmt == "plain":
            tokenizer._tokenizer.chat_template = PLAIN_TEMPLATE
        tokenizer.save_pretrained(str(tmp))
        for extra in ("generation_config.json",):
            if (path / extra).is_file():
                shutil.copy(path / extra, tmp / extra)
        meta = MTPMetadata(
            mask_token_id=mask_id,
            eos_token_ids=_eos_ids(tokenizer, path),
            prompt_format=fmt,
            k=k,
            source=str(src),
        )
        d = meta.to_json()
        if fmt == "plain" and original_template:
            d["chat_template_original"] = original_template
        (tmp / MTP_CONFIG).write_text(json.dumps(d, indent=2) + "\n")
        # config.json is written last: a partial folder never loads
        save_config(config, config_path=tmp / "config.json")
    return dst


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MTPCheckpointError(f"{path}/config.json cannot be read ({e}).") from e


def _load_weights(path: Path, dtype: str | None) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's lazy loader; float weights are cast to ``dtype`` (default: as
    stored). Nothing is evaluated here: a shard whose data is corrupt fails
    when :func:`save_sharded` writes it, inside the temporary folder's life."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    try:
        model, config = load_model(path, lazy=True)
        if dtype is not None:
            target = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}.get(
                dtype
            )
            if target is None:
                raise InvalidArgumentError(f"--dtype must be bfloat16, float16 or float32: {dtype}")
            model.set_dtype(target)
            config["torch_dtype"] = dtype
    except InvalidArgumentError:
        raise
    except Exception as e:
        raise _corrupt(path, e) from e
    return model, config


def _corrupt(path: Path, e: BaseException) -> MTPCheckpointError:
    return MTPCheckpointError(
        f"The weights in {path} cannot be read ({type(e).__name__}: {one_line(e)}); a shard "
        "is corrupt or does not match config.json. Download the checkpoint again."
    )


def save_sharded(
    folder: Path, model: Any, *, max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False
) -> list[str]:
    """Write ``model``'s (lazy) parameters shard by shard, in mlx-lm's layout.

    Each shard's arrays are evaluated only when that shard is written, and the
    model's own references are dropped first (mlx-lm's ``donate_model``), so
    peak memory is about one shard plus the largest tensor in flight, however
    large the model. The layout is ``save_model``'s: ``model.safetensors`` or
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

    Args:
        folder: existing output folder.
        model: an ``mlx.nn.Module``; its parameters are replaced by empty arrays.
        max_shard_bytes: a new shard starts before this size would be passed
            (a larger single tensor gets a shard of its own).
        progress: tqdm bar of bytes written.

    Returns:
        The shard file names, in order.

    Raises:
        Whatever evaluating a lazy parameter raises (a corrupt source shard),
        OSError when the folder cannot be written (a full disk).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import get_total_parameters
    from tqdm import tqdm

    weights = dict(tree_flatten(model.parameters()))
    n_params = get_total_parameters(model)
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    shards: list[dict[str, Any] | None] = []
    size = 0
    for name, v in weights.items():
        if not shards or size + v.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = v
        size += v.nbytes
    total = sum(v.nbytes for v in weights.values())
    weights.clear()
    pattern = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    names, weight_map = [], {}
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="write shards", disable=not progress
    ) as bar:
        for i in range(len(shards)):
            shard, shards[i] = shards[i], None
            fname = pattern.format(i + 1, len(shards))
            with mlx_write_errors(folder / fname):  # a full disk: OSError
                mx.save_safetensors(str(folder / fname), shard, metadata={"format": "mlx"})
            names.append(fname)
            weight_map.update(dict.fromkeys(shard, fname))
            bar.update(sum(v.nbytes for v in shard.values()))
            del shard
    index = {
        "metadata": {"total_size": total, "total_parameters": n_params},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return names


def _eos_ids(tokenizer: Any, path: Path) -> list[int]:
    ids = set(tokenizer_eos_ids(tokenizer))
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            e = json.loads(gen.read_text()).get("eos_token_id")
            ids |= set(e if isinstance(e, list) else [] if e is None else [e])
        except (json.JSONDecodeError, OSError):
            pass
    return sorted(int(i) for i in ids)


__all__ = [
    "MASK_TOKEN",
    "MTPCheckpointError",
    "PLAIN_TEMPLATE",
    "check_shards",
    "convert_mtp_checkpoint",
    "save_sharded",
]
