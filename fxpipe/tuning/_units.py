"""Sizes and rates as people write them: ``'80GiB'``, ``'450GB/s'``, ``'790e12'``, ``64``.

Binary prefixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers
of 1000, as the IEC and SI define them (GPU memory is sold in GiB-ish "GB", links in decimal
GB/s: say which you mean). A bad value is an :class:`~fxpipe.errors.ArgumentError` naming
the argument and the forms it takes.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Union

from ..errors import ArgumentError
from ..plan._value import human_bytes

__all__ = ["parse_bytes", "parse_rate", "parse_seconds", "format_bytes", "format_seconds", "Size", "Seconds"]

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15,
           "ki": 1024.0, "mi": 1024.0 ** 2, "gi": 1024.0 ** 3, "ti": 1024.0 ** 4, "pi": 1024.0 ** 5}
_NUMBER = r"((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[+-]?[0-9]+)?)"
_FORM = re.compile(r"^\s*" + _NUMBER + r"\s*([kmgtp]i?)?\s*(b|bytes?|flops?|/s|b/s|flop/s)?\s*(/s)?\s*$",
                   re.IGNORECASE)

Size = Union[int, float, str]
#: seconds, or a string with a unit: ``'20us'``
Seconds = Union[int, float, str]


def _parse(value: Size, argument: str, example: str) -> float:
    if isinstance(value, bool):
        raise ArgumentError(f"{argument} must be a number or a string such as {example!r}, got {value!r}",
                            argument=argument)
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _FORM.match(str(value))
        if not match:
            raise ArgumentError(f"{argument}={value!r} is not a size: write a number, or a number with a unit "
                                f"such as {example!r} (KiB/MiB/GiB: powers of 1024; KB/MB/GB: of 1000)",
                                argument=argument)
        number = float(match.group(1)) * _PREFIX[(match.group(2) or "").lower()]
    if not (number > 0 and math.isfinite(number)):
        raise ArgumentError(f"{argument} must be positive and finite, got {value!r}", argument=argument)
    return number


def parse_bytes(value: Optional[Size], argument: str) -> Optional[float]:
    """``'80GiB'`` -> 85899345920.0; None stays None (no limit)."""
    return None if value is None else _parse(value, argument, "80GiB")


def parse_rate(value: Optional[Size], argument: str, example: str = "450GB/s") -> Optional[float]:
    """``'450GB/s'`` -> 4.5e11 (per second); ``'790e12'`` -> 7.9e14; None stays None."""
    return None if value is None else _parse(value, argument, example)


_TIME = re.compile(r"^\s*" + _NUMBER + r"\s*(ns|us|\u00b5s|\u03bcs|ms|s)?\s*$", re.IGNORECASE)
#: the micro sign (U+00B5) and the Greek mu (U+03BC) both mean micro
_TIME_UNIT = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "\u03bcs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}


def parse_seconds(value: Seconds, argument: str) -> float:
    """``'20us'`` -> 2e-05, ``'0.5ms'`` -> 0.0005, a number: seconds; zero allowed."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ArgumentError(f"{argument} must be seconds or a string such as '20us', got {value!r}", argument=argument)
    if isinstance(value, str):
        match = _TIME.match(value)
        if not match:
            raise ArgumentError(f"{argument}={value!r} is not a time: write seconds, or a number with a unit "
                                "such as '20us' (ns, us, ms, s)", argument=argument)
        number = float(match.group(1)) * _TIME_UNIT[(match.group(2) or "").lower()]
    else:
        number = float(value)
    if not (number >= 0 and math.isfinite(number)):
        raise ArgumentError(f"{argument} must be zero or more and finite, got {value!r}", argument=argument)
    return number


#: 1536 -> '1.5 KiB': sizes are written as the plan writes them
format_bytes = human_bytes


def format_seconds(seconds: float) -> str:
    """0.00098 -> ``'0.98 ms'``, 2e-05 -> ``'20 us'``: a time as the table's notes write it."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= 0.1 * scale:  # 0.98 ms rather than 980 us
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns" if seconds > 0 else "0"
