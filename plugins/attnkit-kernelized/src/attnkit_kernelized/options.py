"""Validation of constructor options: every message names the option, what was expected and what was given."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from attnkit.errors import InvalidInputError


def _fail(name: str, expected: str, value: Any) -> InvalidInputError:
    return InvalidInputError(f"{name}: expected {expected}, got {value!r}")


def check_int(name: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (None allowed with ``allow_none``); bools and floats are refused."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(name, f"an int >= {minimum}" + (" or None" if allow_none else ""), value)
    return int(value)


def check_float(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                low_inclusive: bool = False, high_inclusive: bool = False, allow_none: bool = False) -> float | None:
    """``value`` as a finite float within the given bounds; ints are accepted, bools and strings are not."""
    if value is None and allow_none:
        return None
    lo = "" if low is None else ("[" if low_inclusive else "(") + f"{low:g}"
    hi = "" if high is None else f"{high:g}" + ("]" if high_inclusive else ")")
    if low is not None and high is not None:
        expected = f"a finite float in {lo}, {hi}"
    elif low is not None:
        expected = f"a finite float {'>=' if low_inclusive else '>'} {low:g}"
    elif high is not None:
        expected = f"a finite float {'<=' if high_inclusive else '<'} {high:g}"
    else:
        expected = "a finite float"
    if allow_none:
        expected += " or None"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, expected, value)
    x = float(value)
    ok = math.isfinite(x)
    if ok and low is not None:
        ok = x >= low if low_inclusive else x > low
    if ok and high is not None:
        ok = x <= high if high_inclusive else x < high
    if not ok:
        raise _fail(name, expected, value)
    return x


def check_bool(name: str, value: Any) -> bool:
    """``value`` when it is a bool (``"no"``, 0 or None are refused, not taken for their truth value)."""
    if not isinstance(value, bool):
        raise _fail(name, "a bool (True or False)", value)
    return value


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` when it is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise _fail(name, f"one of {list(choices)}", value)
    return value


def check_seed(name: str, value: Any) -> int | None:
    """A random seed: an int >= 0 or None."""
    return check_int(name, value, minimum=0, allow_none=True)
