"""Method registry: ``--method`` name -> class.

A draft method subclasses :class:`DraftMethod` (``propose`` an
:class:`~mlx_mtp.offers.Offer`, ``observe`` the outcome; see
docs/contributing.md); a method that commits tokens itself subclasses
:class:`Method` and writes its own ``step``.

A method whose module is not in this install is refused with a clear message;
nothing ever falls back to plain decoding silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any

from ..errors import InvalidArgumentError, UnknownMethodError
from .base import DraftMethod, Method, StepOutput

#: name -> "module:Class" of every built method
METHODS: dict[str, str] = {
    "ntp": "mlx_mtp.methods.ntp:NTP",
    "pld": "mlx_mtp.methods.pld:PLD",
    "probe": "mlx_mtp.methods.probe:Probe",
    "clp": "mlx_mtp.methods.clp:CLP",
    "confadapt": "mlx_mtp.methods.confadapt:ConfAdapt",
    "lookahead": "mlx_mtp.methods.lookahead:Lookahead",
    "hybrid": "mlx_mtp.methods.hybrid:Hybrid",
    "mtp": "mlx_mtp.methods.mtp:MTP",
    "draft": "mlx_mtp.methods.draft:DraftModelMethod",
    "recycle": "mlx_mtp.methods.recycle:Recycle",
}

#: what each method is, for messages about methods not built into this install
DESCRIPTIONS: dict[str, str] = {
    "ntp": "plain next-token decoding",
    "pld": "prompt-lookup decoding",
    "probe": "ESP embedding-space probing",
    "clp": "CLP heads + span predictor",
    "confadapt": "ConfAdapt decoding of self-distilled MTP checkpoints",
    "lookahead": "lookahead (Jacobi) decoding",
    "hybrid": "hybrid probe + n-gram (+ native MTP) draft tree, a chain on recurrent models",
    "mtp": "the checkpoint's native MTP layer (Qwen3.5/3.6, Qwen3-Next, DeepSeek nextn): a chain",
    "draft": "a smaller model of the same tokenizer drafts (--draft-model): a chain or a tree",
    "recycle": "token recycling: a tree from the model's own earlier top-k predictions",
}


def available_methods() -> list[str]:
    """Names of the methods whose module is present in this install."""
    return [n for n, t in METHODS.items() if importlib.util.find_spec(t.split(":")[0])]


def method_class(name: str) -> type[Method]:
    """The class of a method.

    Raises:
        UnknownMethodError: unknown name, or a method that is not built yet.
    """
    if name in METHODS and name in available_methods():
        mod, cls = METHODS[name].split(":")
        return getattr(importlib.import_module(mod), cls)
    avail = ", ".join(available_methods())
    if name in METHODS:
        raise UnknownMethodError(
            f"--method {name} ({DESCRIPTIONS[name]}) is not available in this version of "
            f"mlx-mtp. Available: {avail}."
        )
    raise UnknownMethodError(f"Unknown method {name!r}. Available: {avail}.")


def method_options(cls: type[Method]) -> list[str]:
    """The option names a method class takes (its constructor's keywords)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds]


def make_method(name: str, **options: Any) -> Method:
    """Instantiate a method with its options (see each method's docstring).

    Raises:
        UnknownMethodError: see :func:`method_class`.
        InvalidArgumentError: an option the method does not take (the message
            lists the ones it takes), or a bad option value.
    """
    if not isinstance(name, str):
        raise UnknownMethodError(f"method must be a name such as 'probe', got {name!r}")
    cls = method_class(name)
    takes = method_options(cls)
    unknown = sorted(set(options) - set(takes))
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        listed = ", ".join(takes) if takes else "no options"
        raise InvalidArgumentError(
            f"--method {name} does not take the option{s} {', '.join(unknown)} (given as a flag "
            f"or --opt key=value). It takes: {listed}."
        )
    return cls(**options)


__all__ = [
    "METHODS",
    "available_methods",
    "Method",
    "DraftMethod",
    "StepOutput",
    "make_method",
    "method_class",
    "method_options",
]
