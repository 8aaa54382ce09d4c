"""Option validation from a spec's option schema, before a module is built.

One message format for every implementation::

    build('rfa'): option seed: expected int, got 1.5 (float)

The schema (:class:`attnkit.OptionSpec`) comes from the factory's signature
and docstring, plus the class attribute ``option_constraints`` (ranges,
choices). Constructors keep their own checks as a second line of defence.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import InvalidInputError

__all__ = ["check_options", "check_value", "parse_text"]

_SIMPLE = {"int", "float", "bool", "str", "None", "NoneType"}


def _alternatives(type_text: str) -> list[str]:
    text = type_text.replace("typing.", "").replace("Optional[", "Union[None, ")
    m = re.fullmatch(r"Union\[(.*)\]", text)
    if m:
        text = m.group(1).replace(",", " |")
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "|" and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [p for p in parts if p]


def _literal_values(alt: str) -> tuple[Any, ...] | None:
    m = re.fullmatch(r"Literal\[(.*)\]", alt)
    if not m:
        return None
    out = []
    for raw in m.group(1).split(","):
        raw = raw.strip()
        if raw[:1] in "'\"":
            out.append(raw[1:-1])
        else:
            try:
                out.append(int(raw))
            except ValueError:
                try:
                    out.append(float(raw))
                except ValueError:
                    out.append(raw)
    return tuple(out)


def _typename(value: Any) -> str:
    return type(value).__name__


def _matches(alt: str, value: Any) -> bool | None:
    """True/False for a known type text, None for one we cannot check."""
    if alt in ("None", "NoneType"):
        return value is None
    if alt == "bool":
        return isinstance(value, bool)
    if alt == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if alt == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if alt == "str":
        return isinstance(value, str)
    lit = _literal_values(alt)
    if lit is not None:  # by type too: True is not Literal[1], 1.0 is not Literal[1]
        return any(value == v and type(value) is type(v) for v in lit)
    return None


def _describe(alts: list[str]) -> str:
    """``int or None``, ``one of 'elu', 'relu'``: the alternatives as a reader says them (None last)."""
    words = []
    for a in alts:
        lit = _literal_values(a)
        words.append("one of " + ", ".join(repr(v) for v in lit) if lit is not None else a)
    words.sort(key=lambda w: w in ("None", "NoneType"))
    return " or ".join(words)


def _got(value: Any) -> str:
    return f"got {value!r} ({_typename(value)})"


def check_value(where: str, opt: Any, value: Any) -> None:
    """Raise :class:`InvalidInputError` unless ``value`` fits option ``opt`` (an :class:`OptionSpec`)."""
    alts = _alternatives(opt.type or "any")
    results = [_matches(a, value) for a in alts]
    if value is None and opt.default is None and not opt.required:
        return  # an optional argument left at None
    if results and all(r is not None for r in results) and not any(results):
        raise InvalidInputError(f"{where}: option {opt.name}: expected {_describe(alts)}, {_got(value)}")
    if opt.choices is not None and not any(value == c and type(value) is type(c) for c in opt.choices):
        raise InvalidInputError(
            f"{where}: option {opt.name}: expected one of {list(opt.choices)}, {_got(value)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value) and not opt.allow_nonfinite:
            raise InvalidInputError(f"{where}: option {opt.name}: expected a finite number, {_got(value)}")
        lo, hi = opt.minimum, opt.maximum
        if lo is not None and (value < lo or (opt.exclusive_minimum and value == lo)):
            op = ">" if opt.exclusive_minimum else ">="
            raise InvalidInputError(f"{where}: option {opt.name}: expected a value {op} {lo:g}, {_got(value)}")
        if hi is not None and (value > hi or (opt.exclusive_maximum and value == hi)):
            op = "<" if opt.exclusive_maximum else "<="
            raise InvalidInputError(f"{where}: option {opt.name}: expected a value {op} {hi:g}, {_got(value)}")


def check_options(where: str, schema: Iterable[Any], given: Mapping[str, Any], *, takes_extra: bool = False) -> None:
    """Validate ``given`` options against ``schema``: unknown names (with suggestions), types, ranges, choices.

    Raises:
        InvalidInputError: naming the option, what was expected and what was given.
    """
    by_name = {o.name: o for o in schema}
    unknown = [n for n in given if n not in by_name]
    if unknown and not takes_extra:
        hints = []
        for n in unknown:
            close = difflib.get_close_matches(n, list(by_name), n=1)
            hints.append(f"{n!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise InvalidInputError(f"{where}: unknown option(s) {', '.join(hints)}; it takes: {', '.join(by_name)}")
    for n, value in given.items():
        if n in by_name:
            check_value(where, by_name[n], value)


def parse_text(opt: Any, text: str) -> Any:
    """Parse a command-line ``KEY=VALUE`` value for option ``opt`` by its type.

    bool: true/false/1/0/yes/no/on/off (any case); int and float by their
    syntax; ``None``/``none``/``null`` where None is allowed; JSON for lists;
    anything else stays a string.

    Raises:
        ValueError: a text that fits none of the option's types.
    """
    import json

    alts = _alternatives(opt.type or "any")
    raw = text.strip()
    low = raw.lower()
    if low in ("none", "null") and ("None" in alts or "NoneType" in alts or opt.default is None):
        return None
    if "bool" in alts:
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
    if "int" in alts:
        try:
            return int(raw)
        except ValueError:
            pass
    if "float" in alts:
        try:
            return float(raw)
        except ValueError:
            pass
    for alt in alts:
        lit = _literal_values(alt)
        if lit is not None:
            for v in lit:
                if str(v) == raw:
                    return v
    if "str" in alts:
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if all(a in _SIMPLE for a in alts) and "str" not in alts:
            raise ValueError(f"expected {_describe(alts)}, got {text!r}") from None
        return raw
