"""One place for the ranges of generation arguments, shared by the CLI and the API.

The CLI builds its typer options from :data:`LIMITS` (so a bad value is a usage
error naming the option, exit status 2), and the Python API checks the same
table in :func:`check_generation_args` (an :class:`InvalidArgumentError` naming
the argument). Method options are checked by each method's constructor and by
:func:`mlx_mtp.methods.make_method` (unknown option names); the memory bound on
a forward pass's size by :meth:`mlx_mtp.engine.Engine.check_slots`.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError

#: the largest seed MLX's random state takes (uint64)
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Limit:
    """The valid range of one argument: ``lo <= value <= hi`` (None: unbounded).

    ``cli`` is the option's CLI flag, used in messages."""

    kind: type
    lo: float | None
    hi: float | None
    cli: str
    what: str

    def describe(self) -> str:
        """The range in words: ``>= 1``, ``in [0, 1]`` (integer bounds in full:
        ``in [0, 18446744073709551615]``, never ``1.84467e+19``)."""

        def num(x: float) -> str:
            return f"{x:g}" if self.kind is float else str(int(x))

        if self.hi is None:
            return f">= {num(self.lo)}"
        return f"in [{num(self.lo)}, {num(self.hi)}]"


#: argument name -> its valid range (the API's keyword, the CLI's flag)
LIMITS: dict[str, Limit] = {
    "max_tokens": Limit(int, 1, None, "--max-tokens", "new tokens per answer"),
    "temp": Limit(float, 0.0, None, "--temp", "sampling temperature (0 = greedy)"),
    "top_p": Limit(float, 0.0, 1.0, "--top-p", "nucleus threshold (0 or 1 = off)"),
    "top_k": Limit(int, 0, None, "--top-k", "keep the k most likely tokens (0 = off)"),
    "min_p": Limit(float, 0.0, 1.0, "--min-p", "min-p threshold (0 = off)"),
    "seed": Limit(int, 0, MAX_SEED, "--seed", "random seed"),
    # the window keeps the first 4 tokens (the attention sink) and the last max_kv_size - 4
    "max_kv_size": Limit(int, 16, None, "--max-kv-size", "sliding-window KV cache size"),
}


#: bits of a quantized KV cache (``kv_bits``, ``--kv-bits``)
KV_BITS = (4, 8)
#: elements per quantization group of a quantized KV cache (``--kv-group-size``)
KV_GROUP_SIZES = (32, 64, 128)


def check_kv(kv_bits: Any, kv_group_size: Any, model: Any = None) -> None:
    """Refuse a quantized KV cache setting that cannot run.

    Raises:
        InvalidArgumentError: ``kv_bits`` not None nor one of :data:`KV_BITS`,
            ``kv_group_size`` not one of :data:`KV_GROUP_SIZES`, or (given the
            model) a head dimension the group size does not divide.
    """
    if kv_bits is None:
        return
    if isinstance(kv_bits, bool) or kv_bits not in KV_BITS:
        raise InvalidArgumentError(
            f"kv_bits (--kv-bits) must be one of {', '.join(map(str, KV_BITS))}, got {kv_bits!r}."
        )
    if isinstance(kv_group_size, bool) or kv_group_size not in KV_GROUP_SIZES:
        raise InvalidArgumentError(
            "kv_group_size (--kv-group-size) must be one of "
            f"{', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size!r}."
        )
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    dim = getattr(args, "head_dim", None) or (
        args.hidden_size // heads if heads and getattr(args, "hidden_size", None) else None
    )
    if isinstance(dim, int) and dim % kv_group_size:
        raise InvalidArgumentError(
            f"kv_group_size {kv_group_size} does not divide this model's head dimension "
            f"{dim}; use a --kv-group-size that does."
        )


#: the roles of chat messages, the same for the Python API and the server
#: ("developer" is OpenAI's newer name for "system")
#: chat roles ("developer" is OpenAI's newer name for "system"; "tool" carries a
#: tool call's result back)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def chat_role(role: Any, label: str = "role") -> str:
    """The role a chat template is given for a message's ``role``: one of
    :data:`ROLES`, ``"developer"`` as ``"system"``.

    Raises:
        InvalidArgumentError: any other role; the message names it as ``label``.
    """
    if not isinstance(role, str) or role not in ROLES:
        try:
            shown = json.dumps(role)
        except (TypeError, ValueError):
            shown = repr(role)
        raise InvalidArgumentError(
            f"{label} must be one of {', '.join(sorted(ROLES))}, got {shown}."
        )
    return "system" if role == "developer" else role


def check_flag(name: str, value: Any) -> bool:
    """A yes/no argument as a bool: ``True`` or ``False`` (numpy's bools too).

    Raises:
        InvalidArgumentError: anything else (``"no"``, ``1``, None), which
            Python would count as true or false by its own rules.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise InvalidArgumentError(f"{name} must be True or False, got {value!r}")


#: the keyword arguments of :func:`check_generation_args`
GENERATION_ARGS = ("max_tokens", "temp", "top_p", "top_k", "min_p", "seed")


def check_value(name: str, value: Any, label: str | None = None) -> Any:
    """Check one argument against :data:`LIMITS` and return it as its type.

    Args:
        name: the argument (a key of :data:`LIMITS`).
        value: its value.
        label: how the message names it; None: the API keyword and the CLI
            flag (``temp (--temp)``). The server passes the request's field
            (``temperature``), which knows no flags.

    Raises:
        InvalidArgumentError: wrong type, not finite, or out of range; the
            message names the argument.
    """
    lim = LIMITS[name]
    if label is None:
        label = f"{name} ({lim.cli})"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{label} must be a number, got {value!r}")
    if lim.kind is int:
        if not isinstance(value, numbers.Integral) and not float(value).is_integer():
            raise InvalidArgumentError(f"{label} must be an integer, got {value!r}")
        value = int(value)
    elif not math.isfinite(value):
        raise InvalidArgumentError(f"{label} must be a finite number, got {value!r}")
    if (lim.lo is not None and value < lim.lo) or (lim.hi is not None and value > lim.hi):
        raise InvalidArgumentError(f"{label} must be {lim.describe()}, got {value!r}")
    return lim.kind(value)


def check_generation_args(
    *,
    max_tokens: Any,
    temp: Any,
    top_p: Any = 0.0,
    top_k: Any = 0,
    min_p: Any = 0.0,
    seed: Any = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Check the sampling and length arguments of one generation.

    Args:
        labels: argument -> how a message names it (see :func:`check_value`);
            the arguments left out are named by keyword and CLI flag.

    Returns:
        The arguments as their types (``seed`` None stays None).

    Raises:
        InvalidArgumentError: naming the first bad argument.
    """
    names = labels or {}
    given = {
        "max_tokens": max_tokens,
        "temp": temp,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
    }
    return {
        k: None if k == "seed" and v is None else check_value(k, v, names.get(k))
        for k, v in given.items()
    }


def typer_range(name: str) -> dict[str, Any]:
    """Keyword arguments of a typer option for ``name`` that check its range
    as the option is parsed (a usage error naming the flag): ``min``/``max``
    for integers; for floats a parser that also names what is not a number
    (``nan``) or not finite (:func:`float_range`), which a range check would
    report as out of bounds."""
    lim = LIMITS[name]
    if lim.kind is float:
        return float_range(lim.lo, lim.hi, lim.describe())
    out: dict[str, Any] = {}
    if lim.lo is not None:
        out["min"] = lim.kind(lim.lo)
    if lim.hi is not None:
        out["max"] = lim.kind(lim.hi)
    return out


def float_range(
    lo: float | None = None,
    hi: float | None = None,
    describe: str | None = None,
    *,
    above: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of a typer float option whose value must be a finite
    number in ``[lo, hi]`` (None: unbounded; ``above``: greater than ``lo``):
    a parser that refuses text that is not a number, ``nan`` ("is not a
    number"), ``inf`` ("is not a finite number") and values out of range
    (``describe``, default ``>= lo``, ``> lo`` or ``in [lo, hi]``), each a
    usage error naming the flag."""
    if describe is None:
        if lo is not None and above:
            describe = f"> {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        elif lo is not None:
            describe = Limit(float, lo, hi, "", "").describe()
        else:
            describe = "a number" if hi is None else f"<= {hi:g}"
    return {"parser": _float_parser(lo, hi, describe, above), "metavar": "FLOAT"}


def _float_parser(lo: float | None, hi: float | None, describe: str, above: bool = False) -> Any:
    """``parse(text) -> float`` for a float option (see :func:`float_range`).

    Raises:
        typer.BadParameter: not a number, not finite, or out of range.
    """
    import typer

    def parse(value: Any) -> float:
        if isinstance(value, float):  # the default
            return value
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise typer.BadParameter(f"{value!r} is not a number") from None
        if math.isnan(x):
            raise typer.BadParameter(f"{value} is not a number")
        if not math.isfinite(x):
            raise typer.BadParameter(f"{value} is not a finite number")
        low = lo is not None and (x <= lo if above else x < lo)
        if low or (hi is not None and x > hi):
            raise typer.BadParameter(f"{value} is not {describe}")
        return x

    return parse
