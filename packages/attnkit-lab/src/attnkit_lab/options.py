"""Parsing and range checks of the lab's command-line values.

Every numeric option of ``bench``, ``error``, ``train`` and ``demo`` goes
through :func:`check_int` or :func:`check_float` (or the parsers below, which
call them). A value out of range is a :class:`attnkit.errors.UsageError`
that names the option, the expected range and the value given, e.g.
``--dropout: expected a number in [0, 1), got 1.5``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from attnkit.errors import UsageError

#: the longest sequence length (and budget) accepted: 16M tokens. Inputs of
#: B=1, H=4, D=64 at this length already take 4 GiB per tensor in float32.
MAX_LENGTH = 2 ** 24
#: the largest batch, head count, head dimension or model width accepted
MAX_SIZE = 2 ** 16
#: seeds are 32-bit (derived seeds add offsets to them)
MAX_SEED = 2 ** 32 - 1
#: torch CPU threads
MAX_THREADS = 1024

_SUFFIX = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def _fmt_int(v: int) -> str:
    if v >= 2 ** 16 and v & (v - 1) == 0:
        return f"{v:,} (2**{v.bit_length() - 1})"
    if v >= 2 ** 16 and (v + 1) & v == 0:
        return f"{v:,} (2**{v.bit_length()} - 1)"
    return f"{v:,}" if abs(v) >= 10_000 else str(v)


def _int_range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{_fmt_int(lo)}, {_fmt_int(hi)}]"
    if lo is not None:
        return f">= {_fmt_int(lo)}"
    if hi is not None:
        return f"<= {_fmt_int(hi)}"
    return ""


def check_int(value: Any, option: str, *, lo: int | None = 1, hi: int | None = None,
              what: str = "an integer", given: str | None = None) -> int:
    """``value`` if it is an int in ``[lo, hi]``, else a usage error naming ``option``."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        ok = False
    if not ok:
        shown = given if given is not None else repr(value)
        raise UsageError(f"{option}: expected {what} {_int_range(lo, hi)}, got {shown}".replace("  ", " "))
    return value


def check_float(value: Any, option: str, *, lo: float | None = None, hi: float | None = None,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` if it is a finite number within the bounds, else a usage error naming ``option``.

    ``lo_open``/``hi_open``: the bound itself is excluded.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and lo is not None and (value <= lo if lo_open else value < lo):
        ok = False
    if ok and hi is not None and (value >= hi if hi_open else value > hi):
        ok = False
    if not ok:
        if lo is not None and hi is not None:
            rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            rng = f"{'<' if hi_open else '<='} {hi:g}"
        else:
            rng = ""
        raise UsageError(f"{option}: expected a finite number {rng}, got {value!r}".replace("  ", " "))
    return float(value)


def parse_int(text: str, *, option: str, lo: int = 1, hi: int | None = MAX_LENGTH) -> int:
    """``512``, ``4K``, ``1M`` (K = 1024), within ``[lo, hi]``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise UsageError(f"{option}: expected an integer such as 512, 4K or 1M (K = 1024), got {text!r}")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value != int(value):
        raise UsageError(f"{option}: expected an integer, got {text!r} (= {value:g})")
    value = int(value)
    shown = repr(text.strip()) + (f" (= {value:,})" if str(value) != text.strip() else "")
    return check_int(value, option, lo=lo, hi=hi, given=shown)


def parse_int_list(text: str, *, option: str, lo: int = 1, hi: int | None = MAX_LENGTH) -> list[int]:
    """``256,512,1K`` or a doubling range ``256..8K``; sorted, without repeats."""
    out: list[int] = []
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        if ".." in part:
            lo_s, _, hi_s = part.partition("..")
            a, b = parse_int(lo_s, option=option, lo=max(lo, 1), hi=hi), parse_int(hi_s, option=option, lo=lo, hi=hi)
            if b < a:
                raise UsageError(f"{option}: expected an increasing range such as 256..8K, got {part!r}")
            v = a
            while v <= b:
                out.append(v)
                v *= 2
        else:
            out.append(parse_int(part, option=option, lo=lo, hi=hi))
    if not out:
        raise UsageError(f"{option}: expected at least one value, got {text!r}")
    return sorted(dict.fromkeys(out))


def parse_float_list(text: str, *, option: str) -> list[float]:
    """Comma-separated finite numbers > 0."""
    try:
        vals = [float(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated numbers such as 8,2,0.5, got {text!r}") from None
    if not vals:
        raise UsageError(f"{option}: expected at least one number, got {text!r}")
    for v in vals:
        if not (math.isfinite(v) and v > 0):
            raise UsageError(f"{option}: expected finite numbers > 0, got {v:g} in {text!r}")
    return vals


def check_seed(value: Any, option: str = "--seed") -> int:
    return check_int(value, option, lo=0, hi=MAX_SEED)
