"""Method registry: ``--method`` name -> class.

A method listed in :data:`PLANNED` parses but is refused with a clear message
until it is built; nothing ever falls back to plain decoding silently.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import UnknownMethodError
from .base import Method, StepOutput

#: name -> "module:Class" of every built method
METHODS: dict[str, str] = {
    "ntp": "mlx_mtp.methods.ntp:NTP",
    "pld": "mlx_mtp.methods.pld:PLD",
    "probe": "mlx_mtp.methods.probe:Probe",
}

#: names users may know from the docs that are not built yet
PLANNED: dict[str, str] = {
    "clp": "CLP heads + span predictor",
    "confadapt": "ConfAdapt decoding of self-distilled MTP checkpoints",
    "lookahead": "lookahead (Jacobi) decoding",
    "hybrid": "hybrid probe + n-gram draft tree",
}


def method_class(name: str) -> type[Method]:
    """The class of a method.

    Raises:
        UnknownMethodError: unknown name, or a method that is not built yet.
    """
    if name in METHODS:
        mod, cls = METHODS[name].split(":")
        return getattr(importlib.import_module(mod), cls)
    if name in PLANNED:
        raise UnknownMethodError(
            f"--method {name} ({PLANNED[name]}) is not available in this version of mlx-mtp. "
            f"Available: {', '.join(METHODS)}."
        )
    raise UnknownMethodError(f"Unknown method {name!r}. Available: {', '.join(METHODS)}.")


def make_method(name: str, **options: Any) -> Method:
    """Instantiate a method with its options (see each method's docstring)."""
    return method_class(name)(**options)


__all__ = ["METHODS", "Method", "StepOutput", "make_method", "method_class"]
