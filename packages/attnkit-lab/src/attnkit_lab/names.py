"""Attention choices on the command line: ``NAME`` or ``NAME@key=value,key=value``.

``performer@num_features=64`` builds ``performer`` with ``num_features=64``
and labels its results with the text as given, so one run can compare several
budgets of the same mechanism. Values are parsed as JSON where possible
(``64``, ``0.5``, ``true``, ``null``, ``"text"``), else kept as strings.
``@`` is used (not ``:``, which selects a distribution, nor brackets, which
shells glob).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any

import torch

import attnkit
from attnkit.errors import AmbiguousNameError, UnknownAttentionError, UsageError
from attnkit.registry import default_registry

# Options that set a mechanism's approximation budget, most specific first.
BUDGET_OPTIONS = (
    "num_features", "nb_features", "features", "feature_dim", "num_random_features",
    "num_landmarks", "landmarks", "rank", "proj_dim", "k",
    "window", "window_size", "block_size", "bucket_size", "num_buckets", "num_clusters",
    "top_k", "topk", "memory_size", "mem_len", "num_memories", "span", "max_span",
)
_BUDGET_HINTS = ("feature", "landmark", "rank", "window", "block", "bucket", "cluster", "top", "memory", "span")


@dataclass(frozen=True)
class AttentionChoice:
    """One attention to run.

    Attributes:
        label: the text as given (unique within a run; used in tables and plots).
        name: the registry name part.
        options: build options from ``@key=value`` pairs.
    """

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def with_options(self, **extra: Any) -> AttentionChoice:
        opts = {**self.options, **extra}
        label = self.name + ("@" + ",".join(f"{k}={_fmt(v)}" for k, v in opts.items()) if opts else "")
        return AttentionChoice(label, self.name, opts)


def _fmt(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        low = raw.lower()
        if low in ("true", "false"):
            return low == "true"
        if low in ("none", "null"):
            return None
        return raw


def parse_choice(text: str, *, option: str = "NAME") -> AttentionChoice:
    """Parse ``NAME`` or ``NAME@k=v,k=v``; bad syntax is a usage error."""
    text = text.strip()
    name, sep, rest = text.partition("@")
    if not name:
        raise UsageError(f"{option}: expected an attention name (e.g. 'performer' or "
                         f"'performer@num_features=64'), got {text!r}")
    options: dict[str, Any] = {}
    if sep:
        if not rest:
            raise UsageError(f"{option} {text!r}: expected key=value pairs after '@'")
        for pair in rest.split(","):
            key, eq, raw = pair.partition("=")
            if not eq or not key.strip():
                raise UsageError(f"{option} {text!r}: expected key=value after '@', got {pair!r}")
            options[key.strip()] = _parse_value(raw.strip())
    return AttentionChoice(text, name, options)


def resolve_spec(name: str, *, option: str = "NAME") -> attnkit.AttentionSpec:
    """The spec for ``name``; unknown or ambiguous names become usage errors (with suggestions)."""
    try:
        return attnkit.get_spec(name)
    except (UnknownAttentionError, AmbiguousNameError) as e:
        raise UsageError(f"{option}: {e}") from None


def spec_options(spec: attnkit.AttentionSpec) -> dict[str, Any]:
    """Option name -> OptionSpec; empty when the factory cannot be imported."""
    try:
        return {o.name: o for o in spec.resolved_options()}
    except Exception:  # noqa: BLE001 - a broken import is reported when building
        return {}


def _value_checker() -> Any:
    """``attnkit.options.check_value`` (types, ranges, choices of an option), or None on an older core."""
    try:
        from attnkit.options import check_value
    except ImportError:
        return None
    return check_value


def check_choices(choices: list[AttentionChoice], *, option: str = "NAME") -> list[attnkit.AttentionSpec]:
    """Validate names, option keys and option values before any work starts; returns the specs.

    Values are checked against the spec's option schema where it declares
    types, ranges or choices (``softmax@dropout=1.5`` is refused here, as
    ``build`` would refuse it, instead of being recorded as a failed run); a
    value only the constructor refuses is still recorded per run.
    """
    seen: set[str] = set()
    specs = []
    check_value = _value_checker()
    for c in choices:
        if c.label in seen:
            raise UsageError(f"{option}: {c.label!r} is given twice")
        seen.add(c.label)
        spec = resolve_spec(c.name, option=option)
        opts = spec_options(spec)
        for key, value in c.options.items():
            if opts and key not in opts:
                close = difflib.get_close_matches(key, list(opts), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise UsageError(
                    f"{option} {c.label!r}: {spec.name!r} has no option {key!r}{hint} "
                    f"(options: {', '.join(o for o in opts if o not in ('backend',))})"
                )
            if check_value is not None and key in opts:
                try:
                    check_value(f"{option} {c.label!r}", opts[key], value)
                except ValueError as e:
                    raise UsageError(str(e)) from None
        specs.append(spec)
    return specs


def build(choice: AttentionChoice, *, num_heads: int, head_dim: int, seed: int | None = None,
          **extra: Any) -> attnkit.Attention:
    """Build a choice, passing ``num_heads``/``head_dim`` where the factory takes them.

    ``seed`` seeds torch before construction, so random features drawn at init
    are reproducible.
    """
    if seed is not None:
        torch.manual_seed(seed)
    return default_registry().build_with_hints(
        choice.name, {"num_heads": num_heads, "head_dim": head_dim}, **{**extra, **choice.options}
    )


def default_choices(*, exact: bool | None = None) -> list[AttentionChoice]:
    """Every installed mechanism (``exact=False``: only approximations), by name."""
    specs = attnkit.available() if exact is None else attnkit.available(exact=exact)
    return [AttentionChoice(s.name, s.name) for s in specs]


def budget_option(spec: attnkit.AttentionSpec) -> str | None:
    """The option that sets a mechanism's budget (features, landmarks, rank, window, ...), or None."""
    opts = spec_options(spec)
    for name in BUDGET_OPTIONS:
        if name in opts:
            return name
    for name, o in opts.items():
        if name in ("num_heads", "head_dim", "scale", "backend", "seed"):
            continue
        if any(h in name for h in _BUDGET_HINTS) and o.type in ("int", "int | None", "Optional[int]"):
            return name
    return None


def describe_error(exc: BaseException) -> str:
    """One line for a failure recorded in results."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    kind = type(exc).__name__
    return f"{kind}: {msg}" if msg else kind


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in text or "can't allocate memory" in text or "cannot allocate memory" in text
        or isinstance(exc, MemoryError)
    )


def is_refusal(exc: BaseException) -> bool:
    """The mechanism declined this configuration (a length, causal, a mask, ...)."""
    return isinstance(exc, (ValueError, NotImplementedError)) and not is_oom(exc)
