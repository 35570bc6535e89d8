"""Option values, as a transport decoded them, -> the fields of the internal request (docs/api.md#attention-semantics).

One parser per option, shared by the native HTTP routes (query strings, safetensors metadata
strings, JSON values) and the Open Inference Protocol (JSON parameters over HTTP; ``bool_param``,
``int64_param``, ``double_param`` and ``string_param`` over gRPC): each option is accepted in every
form it can arrive in, and refused with the same message whichever transport carried it. ``what``
names the thing in that message: "option" (native API) or "parameter" (OIP).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import kernels
from kernels.masks import FLOAT32_TINY, LOG2E, as_float32
from service.core.types import LAYOUTS
from service.errors import BadRequest

_TRUE = ("true", "1", "yes", "on")
FAR_WINDOW = 1 << 30  # keys: beyond any sequence (the kernels' own "unbounded" bound)
_FALSE = ("false", "0", "no", "off")
FLOAT32_MAX = 3.4028234663852886e38  # the kernels compute in float32: a larger scale or cap is inf there


def int_text(value: str, signed: bool = False) -> int | None:
    """A decimal integer written in ASCII digits (a leading '+', with ``signed`` a '-', and spaces
    around it allowed), or None: ``str.isdigit`` and ``int`` also take superscripts, other
    scripts' digits and underscores, which a client does not mean as this number."""
    text = value.strip()
    sign = -1 if signed and text.startswith("-") else 1
    text = text.removeprefix("-") if sign < 0 else text.removeprefix("+")
    return sign * int(text) if text.isascii() and text.isdigit() else None


def _number_text(value: str) -> bool:
    """Whether a string may go to ``float``: ASCII, without the underscores Python's literals allow."""
    return value.isascii() and "_" not in value


def parse_bool(name: str, value: Any, what: str = "option") -> bool:
    """A JSON/protobuf bool, the integers 0 and 1, or a string such as "true", "False", "0"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.strip().lower() in _TRUE:
            return True
        if value.strip().lower() in _FALSE:
            return False
    raise BadRequest(f"{what} {name!r} must be a boolean (true/false), got {value!r}")


def parse_layer(name: str, value: Any, what: str = "option") -> int:
    """A session step's layer: an integer >= 0 (any integral type), or a string of decimal digits."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
        return int(value)
    if isinstance(value, str) and (n := int_text(value)) is not None:
        return n
    raise BadRequest(f"{what} {name!r} must be an integer >= 0, got {value!r}")


def parse_scale(name: str, value: Any, what: str = "option", huge: float | None = None) -> float | None:
    """A finite number or a numeric string; None or "" is the default (1/sqrt(D)). Beyond float32's
    range (inf in the kernels): ``huge`` if given, else refused."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    if isinstance(value, bool):
        raise BadRequest(f"{what} {name!r} must be a number, got {value!r}")
    try:
        if isinstance(value, str) and not _number_text(value):
            raise ValueError(value)
        scale = float(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{what} {name!r} must be a number, got {value!r}") from None
    if not math.isfinite(scale):
        raise BadRequest(f"{what} {name!r} must be finite, got {value!r}")
    if abs(scale) > FLOAT32_MAX:
        if huge is not None:
            return huge
        raise BadRequest(f"{what} {name!r} must be within float32's range (|x| <= 3.4e38), got {value!r}")
    if huge is None and not math.isfinite(as_float32(scale * LOG2E)):  # as kernels.spec.check_scale: a 400 here
        raise BadRequest(f"{what} {name!r} must be |x| <= 2.3e38 (float32's range over log2(e), the kernels' "
                         f"base-2 softmax), got {value!r}")
    return scale


def parse_window(name: str, value: Any, what: str = "option") -> tuple[int, int]:
    """flash-attn's (left, right) window: a list [L, R] of ints, or a string "L,R" (brackets or
    parentheses around it allowed); each side >= -1, -1 meaning unbounded. None or "" is (-1, -1).
    A side of FAR_WINDOW or more reaches past any sequence the service holds: it becomes -1, so
    that no kernel argument overflows."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return (-1, -1)
    sides: Any = value
    if isinstance(value, str):
        text = value.strip().removeprefix("[").removeprefix("(").removesuffix("]").removesuffix(")")
        sides = [int_text(x, signed=True) for x in text.split(",")]
    elif isinstance(value, tuple):
        sides = list(value)
    if (not isinstance(sides, list) or len(sides) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in sides)):
        raise BadRequest(f"{what} {name!r} must be two integers left,right (e.g. \"128,0\"; -1: unbounded), "
                         f"got {value!r}")
    if sides[0] < -1 or sides[1] < -1:
        raise BadRequest(f"{what} {name!r} sides must be >= -1 (-1: unbounded), got {value!r}")
    left, right = (-1 if side >= FAR_WINDOW else side for side in sides)
    return (left, right)


def parse_softcap(name: str, value: Any, what: str = "option") -> float:
    """A finite number >= 0 or a numeric string; 0, None or "" is off. A cap beyond float32's range
    bounds nothing (as a far window side): off, not inf in the kernels (inf · tanh(s / inf) is NaN)."""
    cap = parse_scale(name, value, what, huge=0.0)
    if cap is None:
        return 0.0
    if cap < 0:
        raise BadRequest(f"{what} {name!r} must be >= 0 (0: off), got {value!r}")
    if 0 < cap < FLOAT32_TINY:  # as kernels.masks.check_masks: 0 in float32, where 0 / cap is NaN
        raise BadRequest(f"{what} {name!r} must be 0 (off) or at least 1.2e-38 (float32's smallest normal), "
                         f"got {value!r}")
    return cap


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any, str], str]:
    def parse(name: str, value: Any, what: str = "option") -> str:
        if not isinstance(value, str) or value not in choices:
            raise BadRequest(f"{what} {name!r} must be one of {', '.join(choices)}; got {value!r}")
        return value

    return parse


PARSERS: dict[str, Callable[[str, Any, str], Any]] = {
    "causal": parse_bool,
    "return_lse": parse_bool,
    "scale": parse_scale,
    "layout": _choice(LAYOUTS),
    "kernel": _choice(kernels.KERNELS),
    "window_size": parse_window,
    "softcap": parse_softcap,
}


def parse_options(raw: Mapping[str, Any], what: str = "option") -> dict[str, Any]:
    """name -> raw value => name -> the request's value, for the names of ``PARSERS`` (which names
    a call may carry, and what an unknown one means, is the caller's to say)."""
    return {name: PARSERS[name](name, value, what) for name, value in raw.items()}
