"""Option validation shared by the adaptive mechanisms: every refusal names the argument, the expectation, the value."""

from __future__ import annotations

import math
from typing import Any

from attnkit.errors import InvalidInputError

#: the largest ``max_span`` a span module accepts (and the largest ``max_length`` its spec declares)
MAX_SPAN_LIMIT = 65536


def positive_int(name: str, value: Any, *, upper: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (upper is not None and value > upper):
        bound = f"an int in [1, {upper}]" if upper is not None else "a positive int"
        raise InvalidInputError(f"{name}: expected {bound}, got {value!r}")
    return int(value)


def real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
         low_open: bool = False, high_open: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise InvalidInputError(f"{name}: expected a finite float in {interval}, got {value!r}")
    return float(value)
