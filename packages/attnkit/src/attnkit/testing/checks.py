"""The conformance checks as plain functions: one implementation of the kit.

Each ``check_*`` function takes a :class:`ConformanceConfig` and either returns
(the implementation conforms), raises :class:`CheckFailed` (an
``AssertionError``: it does not, and the message says which check, which case,
which argument, and the measured difference against the tolerance), or raises
:class:`CheckSkipped` (the check does not apply, with the reason; never a
vacuous pass).

:class:`attnkit.testing.AttentionConformance` (pytest) and
:func:`run_conformance` (no pytest; used by ``attnkit check``) both call these
functions. This module must not import pytest.

Tensor shapes follow the contract: q ``(B, H, L, D)``, k ``(B, H, S, D)``,
v ``(B, H, S, E)``, output ``(B, H, L, E)``. Inputs are drawn i.i.d. N(0, 1)
in float64 from a seeded :class:`torch.Generator` and then cast, so every dtype
sees the same numbers. Modules are built under a fixed seed inside
:func:`torch.random.fork_rng` (the caller's global RNG is left alone) and put
in eval mode.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..backends import why_unavailable
from ..errors import UnsupportedFeatureError
from ..reference import reference_attention
from ..spec import KNOWN_DTYPES, AttentionSpec, Capabilities

__all__ = [
    "CHECKS", "DEFAULT_ATOL", "DEFAULT_RTOL", "DEFAULT_SHAPES", "CheckFailed", "CheckResult",
    "CheckSkipped", "ConformanceConfig", "ConformanceConfigError", "ConformanceReport",
    "ErrorDistribution", "make_inputs", "run_check", "run_conformance",
]

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

#: Absolute tolerance per dtype for "equals" comparisons of outputs of
#: magnitude ~1 (against the float64 reference, or between two paths).
DEFAULT_ATOL: dict[str, float] = {"float64": 1e-9, "float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
#: Relative tolerance per dtype (``|actual - expected| <= atol + rtol * |expected|``).
DEFAULT_RTOL: dict[str, float] = {"float64": 1e-7, "float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}

#: Default ``(B, H, L, S, D, E)``: self-attention checks use L queries and L
#: keys; cross-attention checks use L queries and S keys (and S queries, L keys).
DEFAULT_SHAPES: tuple[int, int, int, int, int, int] = (2, 2, 9, 12, 8, 6)
#: Streaming chunk sizes; None = the whole sequence in one step.
DEFAULT_STREAMING_CHUNKS: tuple[int | None, ...] = (1, 3, None)


class CheckFailed(AssertionError):
    """A conformance check found a violation of the contract."""


class CheckSkipped(Exception):
    """A check does not apply to this implementation; the message is the reason."""


class ConformanceConfigError(ValueError):
    """The conformance configuration itself is invalid (a typo in ``skip``, a bad shape)."""


@dataclass(frozen=True)
class ErrorDistribution:
    """The stated input distribution of the ``error_bound`` check.

    q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, D)`` drawn i.i.d.
    N(0, std²) in float64 from ``torch.Generator().manual_seed(seed)`` (in the
    order q, k, v), cast to ``dtype``; the module is built with its default
    options plus the configured options (and ``num_heads=H``, ``head_dim=D``
    where the factory takes them) after ``torch.manual_seed(seed)``. The
    measured error is the relative Frobenius norm over the whole output,
    ``||out - ref||_F / ||ref||_F``, where ``ref`` is softmax attention computed
    in float64 (:func:`attnkit.reference.reference_attention`) on the same
    (cast) inputs, for each of ``causal=False`` / ``causal=True`` the spec
    supports. Defaults: B=2, H=2, L=S=64, D=E=16, std=1, seed=0, float32.
    """

    batch: int = 2
    heads: int = 2
    length: int = 64
    dim: int = 16
    std: float = 1.0
    seed: int = 0
    dtype: str = "float32"

    def describe(self, dtype: str | None = None) -> str:
        return (f"q, k, v i.i.d. N(0, {self.std:g}²), B={self.batch}, H={self.heads}, "
                f"L=S={self.length}, D=E={self.dim}, seed {self.seed}, {dtype or self.dtype}")


def _dtype_name(d: str | torch.dtype) -> str:
    if isinstance(d, torch.dtype):
        if d not in _DTYPE_NAMES:
            raise ConformanceConfigError(f"unsupported dtype {d}; use one of {list(DTYPES)}")
        return _DTYPE_NAMES[d]
    name = str(d).removeprefix("torch.")
    if name not in DTYPES:
        raise ConformanceConfigError(f"unsupported dtype {d!r}; use one of {list(DTYPES)}")
    return name


@dataclass
class ConformanceConfig:
    """What to check and how.

    Attributes:
        name: registered name (alias, ``family/name`` or ``distribution:name``).
        options: extra build options; ``num_heads``/``head_dim`` are added from
            the shapes when the factory takes them and they are not given here.
        dtypes: dtypes to test (names or torch dtypes); None = every dtype the
            spec declares. Must be a subset of the declared ones.
        atol, rtol: per-dtype overrides of :data:`DEFAULT_ATOL` / :data:`DEFAULT_RTOL`.
        shapes: ``(B, H, L, S, D, E)``; B >= 2, L >= 4, S >= 2, S != L.
        gradcheck_shapes: ``(B, H, L, S, D, E)`` for ``gradcheck``; None =
            ``shapes`` with B = 1.
        error_distribution: see :class:`ErrorDistribution`.
        streaming_chunks: chunk sizes for the streaming check (None = whole sequence).
        streaming_reference: for ``streaming="segment"``, an optional callable
            ``(attn, q, k, v, chunk) -> Tensor (B, H, L, E) or None`` giving
            the expected concatenated step outputs.
        skip: ``{check_name: reason}``; the reasons are reported.
        device: where tensors and modules live.
        seed: seeds module construction and inputs.
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    dtypes: Sequence[str | torch.dtype] | None = None
    atol: Mapping[str | torch.dtype, float] = field(default_factory=dict)
    rtol: Mapping[str | torch.dtype, float] = field(default_factory=dict)
    shapes: Sequence[int] = DEFAULT_SHAPES
    gradcheck_shapes: Sequence[int] | None = None
    error_distribution: ErrorDistribution = field(default_factory=ErrorDistribution)
    streaming_chunks: Sequence[int | None] = DEFAULT_STREAMING_CHUNKS
    streaming_reference: Callable[..., Tensor | None] | None = None
    skip: Mapping[str, str] = field(default_factory=dict)
    device: str | torch.device = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConformanceConfigError(
                f"name: expected the registered name of the implementation to check, got {self.name!r}"
            )
        self.options = dict(self.options or {})
        self.shapes = _check_shapes("shapes", self.shapes)
        if self.gradcheck_shapes is not None:
            self.gradcheck_shapes = _check_shapes("gradcheck_shapes", self.gradcheck_shapes, min_batch=1)
        unknown = set(self.skip) - set(CHECKS)
        if unknown:
            raise ConformanceConfigError(
                f"skip: unknown check name(s) {sorted(unknown)}; the checks are {list(CHECKS)}"
            )
        if isinstance(self.error_distribution, Mapping):
            self.error_distribution = ErrorDistribution(**self.error_distribution)
        _dtype_name(self.error_distribution.dtype)
        self.atol = {**DEFAULT_ATOL, **{_dtype_name(k): float(v) for k, v in self.atol.items()}}
        self.rtol = {**DEFAULT_RTOL, **{_dtype_name(k): float(v) for k, v in self.rtol.items()}}
        self.device = torch.device(self.device)
        for c in self.streaming_chunks:
            if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
                raise ConformanceConfigError(f"streaming_chunks: expected positive ints or None, got {c!r}")
        self._spec: AttentionSpec | None = None

    # -- derived ------------------------------------------------------------
    @property
    def spec(self) -> AttentionSpec:
        if self._spec is None:
            from ..registry import default_registry

            self._spec = default_registry().resolve(self.name)
        return self._spec

    @property
    def caps(self) -> Capabilities:
        return self.spec.capabilities

    def tested_dtypes(self) -> list[str]:
        """Dtype names to test: the configured ones, else every declared one."""
        declared = list(self.caps.dtypes)
        if self.dtypes is None:
            return declared
        names = [_dtype_name(d) for d in self.dtypes]
        extra = [n for n in names if n not in declared]
        if extra:
            raise ConformanceConfigError(
                f"dtypes_to_test: {extra} not declared by {self.spec.name!r} (declares {declared}); "
                "an undeclared dtype must be refused, which the 'refusals' check tests"
            )
        return names

    def tol(self, dtype: str | torch.dtype) -> tuple[float, float]:
        name = _dtype_name(dtype)
        return self.atol[name], self.rtol[name]


def _check_shapes(what: str, shapes: Sequence[int], *, min_batch: int = 2) -> tuple[int, ...]:
    shapes = tuple(shapes)
    if len(shapes) != 6 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shapes):
        raise ConformanceConfigError(f"{what}: expected six positive ints (B, H, L, S, D, E), got {shapes!r}")
    B, _, L, S, _, _ = shapes
    if B < min_batch or L < 4 or S < 2 or S == L:
        raise ConformanceConfigError(
            f"{what}: need B >= {min_batch}, L >= 4, S >= 2 and S != L (S is the cross-attention key "
            f"length), got (B, H, L, S, D, E) = {shapes}"
        )
    return shapes


# ---------------------------------------------------------------- inputs
def make_inputs(B: int, H: int, L: int, S: int, D: int, E: int, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", seed: int = 0, std: float = 1.0,
                requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` i.i.d. N(0, std²).

    Drawn in float64 from ``torch.Generator().manual_seed(seed)`` (q, then k,
    then v) and cast to ``dtype``, so every dtype sees the same numbers.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((B, H, L, D), (B, H, S, D), (B, H, S, E)):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(device=device, dtype=dtype)
        out.append(t.requires_grad_(requires_grad))
    return out[0], out[1], out[2]


def _noise_like(x: Tensor, seed: int, scale: float = 3.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(x.shape, generator=g, dtype=torch.float64) * scale).to(device=x.device, dtype=x.dtype)


def _perturb(x: Tensor, where: Tensor, seed: int) -> Tensor:
    """``x`` plus large noise where the bool ``where`` (broadcastable to ``x``) is True."""
    return torch.where(where, x + _noise_like(x, seed), x)


def _positions(n: int, start: int, device: torch.device) -> Tensor:
    """Bool ``(1, 1, n, 1)``: True at positions >= start (along dim 2)."""
    return (torch.arange(n, device=device) >= start)[None, None, :, None]


def _padding_mask(B: int, S: int, device: torch.device) -> Tensor:
    """Bool ``(B, S)`` with some padded keys per row, never key 0, never a whole row.

    Even rows pad the last third (right padding); odd rows pad keys 1 and S//2
    (padding in the middle, which the contract allows).
    """
    kpm = torch.ones(B, S, dtype=torch.bool, device=device)
    for b in range(B):
        if b % 2 == 0:
            kpm[b, S - max(1, S // 3):] = False
        else:
            kpm[b, 1] = False
            kpm[b, max(2, S // 2)] = False
    return kpm


def _parity_mask(B: int, H: int, L: int, S: int, device: torch.device) -> Tensor:
    """Bool ``(B, H, L, S)``: query i of (b, h) may see key j iff ``j == 0`` or ``(i + b + h) % 2 == j % 2``.

    Key 0 is visible to every query, so no row is fully masked, causal or not.
    """
    i = torch.arange(L, device=device)[None, None, :, None]
    j = torch.arange(S, device=device)[None, None, None, :]
    b = torch.arange(B, device=device)[:, None, None, None]
    h = torch.arange(H, device=device)[None, :, None, None]
    return ((i + b + h) % 2 == j % 2) | (j == 0)


def _bool_to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _fmt_shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _describe_kwargs(kw: Mapping[str, Any]) -> str:
    parts = []
    for k, v in kw.items():
        if isinstance(v, Tensor):
            parts.append(f"{k}=<{_DTYPE_NAMES.get(v.dtype, str(v.dtype))} {_fmt_shape(v)}>")
        else:
            parts.append(f"{k}={v!r}")
    return ", ".join(parts)


# ------------------------------------------------------------- the context
class _Ctx:
    """Helpers shared by the checks: building, calling, comparing, failing."""

    def __init__(self, check: str, cfg: ConformanceConfig) -> None:
        self.check = check
        self.cfg = cfg
        self.spec = cfg.spec
        self.caps = cfg.caps
        self.device = cfg.device
        B, H, L, S, D, E = cfg.shapes
        self.B, self.H, self.L, self.S, self.D, self.E = B, H, L, S, D, E
        try:
            self._takes = {o.name for o in self.spec.resolved_options()}
        except Exception:  # noqa: BLE001 - build reports import problems with their reason
            self._takes = {"num_heads", "head_dim"}

    # -- outcomes
    def fail(self, msg: str) -> None:
        __tracebackhide__ = True
        raise CheckFailed(f"[{self.check}] {self.spec.name!r}: {msg}")

    def skip(self, reason: str) -> None:
        raise CheckSkipped(reason)

    # -- dtypes and modes
    def dtypes(self) -> list[torch.dtype]:
        return [DTYPES[n] for n in self.cfg.tested_dtypes()]

    def precise(self) -> torch.dtype:
        """float64 where declared (tight tolerances for invariance checks), else float32, else the first."""
        for name in ("float64", "float32"):
            if name in self.caps.dtypes:
                return DTYPES[name]
        return DTYPES[self.caps.dtypes[0]]

    def float_dtypes(self) -> list[torch.dtype]:
        """float32 / float64 among the tested dtypes (for gradients); at least the precise one."""
        out = [d for d in self.dtypes() if d in (torch.float32, torch.float64)]
        return out or [self.precise()]

    def causal_modes(self) -> list[bool]:
        return [c for c, ok in ((False, self.caps.noncausal), (True, self.caps.causal)) if ok]

    def tol(self, dtype: torch.dtype, factor: float = 1.0) -> tuple[float, float]:
        atol, rtol = self.cfg.tol(dtype)
        return atol * factor, rtol * factor

    # -- building and calling
    def build(self, *, dtype: torch.dtype | None = None, heads: int | None = None,
              head_dim: int | None = None, seed: int | None = None, **extra: Any) -> Any:
        """Build the implementation under ``torch.manual_seed(seed)`` (RNG forked), eval mode."""
        from ..registry import default_registry

        hints = {"num_heads": self.H if heads is None else heads,
                 "head_dim": self.D if head_dim is None else head_dim}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed if seed is None else seed)
            attn = default_registry().build_with_hints(self.cfg.name, hints, **{**self.cfg.options, **extra})
        attn = attn.to(device=self.device)
        if dtype is not None:
            attn = attn.to(dtype=dtype)
        return attn.eval()

    def inputs(self, L: int, S: int, dtype: torch.dtype, *, seed_offset: int = 0, B: int | None = None,
               requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        return make_inputs(self.B if B is None else B, self.H, L, S, self.D, self.E, dtype=dtype,
                           device=self.device, seed=self.cfg.seed * 1000 + 17 + seed_offset,
                           requires_grad=requires_grad)

    def call(self, attn: Any, case: str, q: Tensor, k: Tensor, v: Tensor, *, grad: bool = False,
             **kw: Any) -> Tensor:
        """``attn(q, k, v, **kw)``; any exception or a malformed result is a failure naming the case."""
        __tracebackhide__ = True
        try:
            with torch.set_grad_enabled(grad):
                out = attn(q, k, v, **kw)
        except Exception as exc:  # noqa: BLE001 - reported as a failure with context
            self.fail(
                f"{case}: forward(q {_fmt_shape(q)}, k {_fmt_shape(k)}, v {_fmt_shape(v)}"
                f"{', ' if kw else ''}{_describe_kwargs(kw)}) raised {type(exc).__name__}: {exc}"
            )
        expected = (*q.shape[:3], v.shape[-1])
        if not isinstance(out, Tensor):
            self.fail(f"{case}: forward returned {type(out).__name__}, expected a Tensor {expected}")
        if tuple(out.shape) != expected:
            self.fail(f"{case}: output shape {tuple(out.shape)}, expected (B, H, L, E) = {expected}")
        return out

    def close(self, actual: Tensor, expected: Tensor, case: str, *, dtype: torch.dtype,
              what: str = "output", atol: float | None = None, rtol: float | None = None,
              against: str = "expected") -> None:
        """Fail unless ``|actual - expected| <= atol + rtol·|expected|`` everywhere (and finite)."""
        __tracebackhide__ = True
        d_atol, d_rtol = self.tol(dtype)
        atol = d_atol if atol is None else atol
        rtol = d_rtol if rtol is None else rtol
        a = actual.detach().to(torch.float64)
        e = expected.detach().to(torch.float64)
        if a.shape != e.shape:
            self.fail(f"{case}: {what} has shape {tuple(a.shape)}, {against} {tuple(e.shape)}")
        for t, label, other in ((a, what, e), (e, against, a)):
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                idx = tuple(int(i) for i in bad.nonzero()[0])
                self.fail(f"{case}: {label} has {int(bad.sum())} non-finite value(s), e.g. {t[idx].item()} "
                          f"at index {idx} (the other side: {other[idx].item():.6g})")
        diff = (a - e).abs().nan_to_num(nan=math.inf)
        excess = diff - (atol + rtol * e.abs())
        if bool((excess > 0).any()):
            flat = int(excess.flatten().argmax())
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
            self.fail(
                f"{case}: {what} vs {against}: max |diff| = {diff.max().item():.3g}; worst at "
                f"index {idx}: got {a[idx].item():.6g}, {against} {e[idx].item():.6g}; tolerance "
                f"atol={atol:.3g} + rtol={rtol:.3g}·|{against}| ({_DTYPE_NAMES.get(dtype, dtype)}, "
                f"{int((excess > 0).sum())} of {excess.numel()} elements outside)"
            )

    def finite(self, t: Tensor | None, case: str, what: str) -> None:
        __tracebackhide__ = True
        if t is None:
            return
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            self.fail(f"{case}: {what} has {int(bad.sum())} non-finite value(s) (NaN/inf), e.g. "
                      f"{t.detach()[idx].item()} at index {idx}")


def _case(**kw: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items() if v is not None)


def _grads(attn: Any, out: Tensor, inputs: Sequence[Tensor], seed: int) -> list[Tensor | None]:
    params = [p for p in attn.parameters() if p.requires_grad]
    g = _noise_like(out, seed, scale=1.0)
    got = torch.autograd.grad(out, list(inputs) + params, g, allow_unused=True)
    return list(got)


# ================================================================= checks
def _isolated(fn: Callable[[ConformanceConfig], None]) -> Callable[[ConformanceConfig], None]:
    """Run a check inside :func:`torch.random.fork_rng` (the caller's RNG state is left alone) and
    with one intra-op CPU thread (restored after).

    The kit's tensors are tiny: intra-op threads buy nothing there, and on a
    busy machine (other test processes, a training run) oversubscribed threads
    made the checks 20-30x slower.
    """

    @functools.wraps(fn)
    def wrapper(cfg: ConformanceConfig) -> None:
        __tracebackhide__ = True  # pytest: start tracebacks at the check
        device = torch.device(cfg.device)
        devices = [device] if device.type == "cuda" else []
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            with torch.random.fork_rng(devices=devices):
                fn(cfg)
        finally:
            torch.set_num_threads(threads)

    return wrapper


def check_shapes_dtypes(cfg: ConformanceConfig) -> None:
    """Output shape ``(B, H, L, E)`` (with E != D), dtype and device of the input, finite, inputs untouched.

    For every tested dtype and every declared causal mode, on self-attention
    inputs of ``shapes``.
    """
    c = _Ctx("shapes_dtypes", cfg)
    for dt in c.dtypes():
        attn = c.build(dtype=dt)
        q, k, v = c.inputs(c.L, c.L, dt)
        before = [t.clone() for t in (q, k, v)]
        for causal in c.causal_modes():
            case = _case(causal=causal, dtype=_DTYPE_NAMES[dt], L=c.L, S=c.L)
            out = c.call(attn, case, q, k, v, causal=causal)
            if out.dtype != dt:
                c.fail(f"{case}: output dtype {out.dtype}, expected the input dtype {dt}")
            if out.device != q.device:
                c.fail(f"{case}: output on {out.device}, expected the input device {q.device}")
            c.finite(out, case, "output")
        for name, t, b in zip("qkv", (q, k, v), before):
            if not torch.equal(t, b):
                c.fail(f"dtype={_DTYPE_NAMES[dt]}: forward modified its input {name} in place")


def check_refusals(cfg: ConformanceConfig) -> None:
    """Every capability the spec lacks is refused with :class:`~attnkit.errors.UnsupportedFeatureError`.

    Covers causal, noncausal, key_padding_mask, attn_mask, cross (L != S),
    causal cross, streaming (``init_state`` and ``step``) and undeclared
    dtypes. The error must name the implementation. Skipped when the spec
    declares everything.
    """
    c = _Ctx("refusals", cfg)
    caps = c.caps
    dt = c.precise()
    attn = c.build(dtype=dt)
    q, k, v = c.inputs(c.L, c.L, dt)
    qx, kx, vx = c.inputs(c.L, c.S, dt, seed_offset=1)
    ok_causal = not caps.noncausal  # a mode the implementation accepts
    tried: list[str] = []

    def expect_refusal(label: str, lacking: str, fn: Callable[[], Any]) -> None:
        tried.append(label)
        try:
            with torch.no_grad():
                fn()
        except UnsupportedFeatureError as exc:
            if c.spec.name not in str(exc):
                c.fail(f"{label}: the UnsupportedFeatureError does not name the implementation: {exc}")
            return
        except Exception as exc:  # noqa: BLE001
            c.fail(f"{label}: the spec does not declare {lacking}, and the call raised {type(exc).__name__}: "
                   f"{exc}; it must raise attnkit.errors.UnsupportedFeatureError")
        c.fail(f"{label}: the spec does not declare {lacking}, yet the call was accepted silently; "
               "it must raise attnkit.errors.UnsupportedFeatureError (nothing is ever silently ignored)")

    if not caps.causal:
        expect_refusal("forward(causal=True)", "causal", lambda: attn(q, k, v, causal=True))
    if not caps.noncausal:
        expect_refusal("forward(causal=False)", "noncausal", lambda: attn(q, k, v, causal=False))
    if not caps.key_padding_mask:
        kpm = torch.ones(c.B, c.L, dtype=torch.bool, device=c.device)
        expect_refusal("forward(key_padding_mask=...)", "key_padding_mask",
                       lambda: attn(q, k, v, causal=ok_causal, key_padding_mask=kpm))
    if not caps.attn_mask:
        m = torch.ones(c.L, c.L, dtype=torch.bool, device=c.device)
        expect_refusal("forward(attn_mask=...)", "attn_mask",
                       lambda: attn(q, k, v, causal=ok_causal, attn_mask=m))
    if not caps.cross and caps.noncausal:
        expect_refusal(f"forward(causal=False) with L={c.L} != S={c.S}", "cross",
                       lambda: attn(qx, kx, vx, causal=False))
    if caps.causal and not caps.causal_cross:
        expect_refusal(f"forward(causal=True) with L={c.L} != S={c.S}", "causal_cross",
                       lambda: attn(qx, kx, vx, causal=True))
    if caps.streaming is None:
        expect_refusal("init_state(B)", "streaming", lambda: attn.init_state(c.B, device=c.device, dtype=dt))
        expect_refusal("step(q, k, v, state)", "streaming", lambda: attn.step(q, k, v, {}))
    for name in KNOWN_DTYPES:
        if name not in caps.dtypes:
            qd, kd, vd = (t.to(DTYPES[name]) for t in (q, k, v))
            expect_refusal(f"forward with {name} inputs", f"dtype {name}",
                           lambda qd=qd, kd=kd, vd=vd: attn(qd, kd, vd, causal=ok_causal))
    if not tried:
        c.skip("the spec declares every capability the kit can refuse-test "
               "(causal, noncausal, key_padding_mask, attn_mask, cross, causal_cross, streaming, all dtypes)")


def check_causality(cfg: ConformanceConfig) -> None:
    """With ``causal=True``, perturbing q, k, v at positions >= t changes no output at positions < t.

    Self-attention (L = L) for several t; with ``causal_cross`` also L != S
    (bottom-right aligned: query i sees keys ``j <= i + S - L``) in both
    directions. Compared in float64 where declared.
    """
    c = _Ctx("causality", cfg)
    if not c.caps.causal:
        c.skip("the spec does not declare causal (its refusal is tested by 'refusals')")
    dt = c.precise()
    attn = c.build(dtype=dt)
    shapes = [(c.L, c.L)]
    if c.caps.causal_cross:
        shapes += [(c.L, c.S), (c.S, c.L)]
    for n, (L, S) in enumerate(shapes):
        q, k, v = c.inputs(L, S, dt, seed_offset=n)
        base = c.call(attn, _case(causal=True, L=L, S=S), q, k, v, causal=True)
        cuts = sorted({t for t in (1, L // 2, L - 1) if 1 <= t + S - L <= S - 1 and 1 <= t < L})
        for t in cuts:
            kt = t + S - L  # first key position query t-1 cannot see
            q2 = _perturb(q, _positions(L, t, c.device), seed=100 + t)
            k2 = _perturb(k, _positions(S, kt, c.device), seed=200 + t)
            v2 = _perturb(v, _positions(S, kt, c.device), seed=300 + t)
            case = _case(causal=True, L=L, S=S, dtype=_DTYPE_NAMES[dt])
            out = c.call(attn, case, q2, k2, v2, causal=True)
            c.close(out[:, :, :t], base[:, :, :t],
                    f"{case}: perturbing queries at positions >= {t} and keys/values at positions >= {kt} "
                    f"changed outputs at positions < {t}, so the implementation leaks the future",
                    dtype=dt, what="past outputs", against="unperturbed")


def check_key_padding(cfg: ConformanceConfig) -> None:
    """Padded keys have no influence: perturbing their k and v changes no output.

    ``key_padding_mask`` (B, S), True = real token; padding at the end and in
    the middle. Every declared causal mode, self-attention and (when declared)
    cross-attention. An all-True mask must equal no mask.
    """
    c = _Ctx("key_padding", cfg)
    if not c.caps.key_padding_mask:
        c.skip("the spec does not declare key_padding_mask (its refusal is tested by 'refusals')")
    dt = c.precise()
    attn = c.build(dtype=dt)
    setups = [(c.L, c.L, causal) for causal in c.causal_modes()]
    if c.caps.cross and c.caps.noncausal:
        setups += [(c.L, c.S, False), (c.S, c.L, False)]
    if c.caps.causal_cross:
        setups += [(c.L, c.S, True)]
    for n, (L, S, causal) in enumerate(setups):
        q, k, v = c.inputs(L, S, dt, seed_offset=n)
        kpm = _padding_mask(c.B, S, c.device)
        case = _case(causal=causal, L=L, S=S, dtype=_DTYPE_NAMES[dt], key_padding_mask="<padded (B, S)>")
        base = c.call(attn, case, q, k, v, causal=causal, key_padding_mask=kpm)
        c.finite(base, case, "output")
        pad = ~kpm[:, None, :, None]
        k2, v2 = _perturb(k, pad, seed=400 + n), _perturb(v, pad, seed=500 + n)
        out = c.call(attn, case, q, k2, v2, causal=causal, key_padding_mask=kpm)
        c.close(out, base, f"{case}: perturbing k and v at padded positions changed the output, so "
                "key_padding_mask is not honoured (True = real token)", dtype=dt, against="unperturbed")
        ones = torch.ones_like(kpm)
        case1 = _case(causal=causal, L=L, S=S, dtype=_DTYPE_NAMES[dt], key_padding_mask="<all True>")
        c.close(c.call(attn, case1, q, k, v, causal=causal, key_padding_mask=ones),
                c.call(attn, case1, q, k, v, causal=causal),
                f"{case1}: an all-True key_padding_mask changed the output", dtype=dt, against="no mask")


def check_fully_masked_rows(cfg: ConformanceConfig) -> None:
    """A query row that sees no key gives zeros (not NaN), and gradients stay finite.

    Cases, as declared: a batch row whose keys are all padded; causal with key
    0 padded (query 0 sees nothing); an ``attn_mask`` row that is all False
    (bool) or all -inf (float); ``causal_cross`` with L > S (the first L - S
    queries see nothing). Forward in every tested dtype (|out| <= atol),
    gradients of q, k, v and parameters in float32/float64.
    """
    c = _Ctx("fully_masked_rows", cfg)
    caps = c.caps
    B, L, S = c.B, c.L, c.S
    cases: list[tuple[str, int, int, dict[str, Any], Callable[[Tensor], Tensor]]] = []
    if caps.key_padding_mask:
        kpm = torch.ones(B, L, dtype=torch.bool, device=c.device)
        kpm[1] = False
        for causal in c.causal_modes():
            cases.append((_case(causal=causal, key_padding_mask="<batch 1 all padded>"), L, L,
                          {"causal": causal, "key_padding_mask": kpm}, lambda o: o[1]))
        if caps.causal:
            kpm0 = torch.ones(B, L, dtype=torch.bool, device=c.device)
            kpm0[0, 0] = False
            cases.append((_case(causal=True, key_padding_mask="<key 0 of batch 0 padded>"), L, L,
                          {"causal": True, "key_padding_mask": kpm0}, lambda o: o[0, :, 0]))
    if caps.attn_mask:
        m = torch.ones(L, L, dtype=torch.bool, device=c.device)
        m[2] = False
        for causal in c.causal_modes():
            cases.append((_case(causal=causal, attn_mask="<bool, row 2 all False>"), L, L,
                          {"causal": causal, "attn_mask": m}, lambda o: o[:, :, 2]))
            cases.append((_case(causal=causal, attn_mask="<float, row 2 all -inf>"), L, L,
                          {"causal": causal, "attn_mask": "additive"}, lambda o: o[:, :, 2]))
    if caps.causal_cross:
        Lq, Sk = max(L, S), min(L, S)
        cases.append((_case(causal=True, L=Lq, S=Sk), Lq, Sk, {"causal": True},
                      lambda o, n=Lq - Sk: o[:, :, :n]))
    if not cases:
        c.skip("no declared capability can produce a fully masked row "
               "(no key_padding_mask, attn_mask or causal_cross)")
    grad_dtypes = c.float_dtypes()
    for dt in c.dtypes():
        attn = c.build(dtype=dt)
        atol, _ = c.tol(dt)
        for n, (label, Lq, Sk, kw, rows) in enumerate(cases):
            kw = dict(kw)
            if isinstance(kw.get("attn_mask"), str):
                kw["attn_mask"] = _bool_to_additive(m, dt)
            case = f"{label}, L={Lq}, S={Sk}, dtype={_DTYPE_NAMES[dt]}"
            with_grad = dt in grad_dtypes
            q, k, v = c.inputs(Lq, Sk, dt, seed_offset=n, requires_grad=with_grad)
            out = c.call(attn, case, q, k, v, grad=with_grad, **kw)
            c.finite(out, case, "output")
            masked = rows(out).detach()
            worst = masked.abs().max().item() if masked.numel() else 0.0
            if not worst <= atol:
                c.fail(f"{case}: fully masked query rows must be 0, got max |out| = {worst:.3g} "
                       f"(tolerance {atol:.3g})")
            if with_grad:
                grads = _grads(attn, out, (q, k, v), seed=600 + n)
                names = ["q.grad", "k.grad", "v.grad"] + [f"grad of parameter {p}" for p, t
                                                          in attn.named_parameters() if t.requires_grad]
                for name, g in zip(names, grads):
                    c.finite(g, case, name)


def check_attn_mask(cfg: ConformanceConfig) -> None:
    """A declared ``attn_mask`` is honoured: masked-out (query, key) pairs have no influence.

    The mask ``(B, H, L, S)`` lets query i of (b, h) see key j iff j = 0 or
    ``(i + b + h) % 2 == j % 2``; perturbing the keys/values j >= 1 of one
    parity must leave the rows that may not see them unchanged. Bool and additive
    (0 / -inf) forms agree, and an ``(L, S)`` mask equals its expansion.
    Every declared causal mode, self- and (when declared) cross-attention.
    """
    c = _Ctx("attn_mask", cfg)
    if not c.caps.attn_mask:
        c.skip("the spec does not declare attn_mask (its refusal is tested by 'refusals')")
    dt = c.precise()
    attn = c.build(dtype=dt)
    setups = [(c.L, c.L, causal) for causal in c.causal_modes()]
    if c.caps.cross and c.caps.noncausal:
        setups.append((c.L, c.S, False))
    B, H = c.B, c.H
    for n, (L, S, causal) in enumerate(setups):
        q, k, v = c.inputs(L, S, dt, seed_offset=n)
        mask = _parity_mask(B, H, L, S, c.device)
        dname = _DTYPE_NAMES[dt]
        case = _case(causal=causal, L=L, S=S, dtype=dname, attn_mask="<bool parity (B, H, L, S)>")
        base = c.call(attn, case, q, k, v, causal=causal, attn_mask=mask)
        c.finite(base, case, "output")
        j = torch.arange(S, device=c.device)[None, None, :, None]
        i_parity = ((torch.arange(L, device=c.device)[None, None, :] + torch.arange(B, device=c.device)
                     [:, None, None] + torch.arange(H, device=c.device)[None, :, None]) % 2)
        for p in (0, 1):
            keys = (j % 2 == p) & (j >= 1)
            k2 = _perturb(k, keys, seed=700 + 2 * n + p)
            v2 = _perturb(v, keys, seed=800 + 2 * n + p)
            out = c.call(attn, case, q, k2, v2, causal=causal, attn_mask=mask)
            blind = (i_parity != p)[..., None]  # rows that may not see parity-p keys
            c.close(torch.where(blind, out, base), base,
                    f"{case}: perturbing keys/values at {'even' if p == 0 else 'odd'} positions >= 1 changed "
                    "query rows the mask forbids from seeing them, so attn_mask is not honoured",
                    dtype=dt, what="rows that may not see them", against="unperturbed")
        add = _bool_to_additive(mask, dt)
        case_f = _case(causal=causal, L=L, S=S, dtype=dname, attn_mask="<additive 0/-inf (B, H, L, S)>")
        c.close(c.call(attn, case_f, q, k, v, causal=causal, attn_mask=add), base,
                f"{case_f}: the additive form of the mask disagrees with the bool form", dtype=dt,
                against="bool mask")
        m2 = mask[0, 0]
        case_b = _case(causal=causal, L=L, S=S, dtype=dname, attn_mask="<bool (L, S)>")
        c.close(c.call(attn, case_b, q, k, v, causal=causal, attn_mask=m2),
                c.call(attn, case_b, q, k, v, causal=causal, attn_mask=m2.expand(B, H, L, S).contiguous()),
                f"{case_b}: an (L, S) mask disagrees with the same mask expanded to (B, H, L, S)",
                dtype=dt, against="expanded mask")


def check_cross_attention(cfg: ConformanceConfig) -> None:
    """Declared cross-attention (L != S, both L < S and L > S) gives ``(B, H, L, E)``, finite, every dtype.

    ``causal=False`` when ``cross``; ``causal=True`` (bottom-right aligned)
    when ``causal_cross``. Values are checked by 'reference' (exact) and
    'key_padding' (padded keys); this check makes a declared L != S work at all.
    """
    c = _Ctx("cross_attention", cfg)
    modes = []
    if c.caps.cross and c.caps.noncausal:
        modes.append(False)
    if c.caps.causal_cross:
        modes.append(True)
    if not modes:
        c.skip("the spec declares neither cross nor causal_cross (their refusal is tested by 'refusals')")
    for dt in c.dtypes():
        attn = c.build(dtype=dt)
        for n, (L, S) in enumerate(((c.L, c.S), (c.S, c.L))):
            q, k, v = c.inputs(L, S, dt, seed_offset=n)
            for causal in modes:
                case = _case(causal=causal, L=L, S=S, dtype=_DTYPE_NAMES[dt])
                out = c.call(attn, case, q, k, v, causal=causal)
                if out.dtype != dt:
                    c.fail(f"{case}: output dtype {out.dtype}, expected {dt}")
                c.finite(out, case, "output")


def check_batch_independence(cfg: ConformanceConfig) -> None:
    """Batch elements do not interact: perturbing batch 1's q, k, v leaves batch 0's output unchanged."""
    c = _Ctx("batch_independence", cfg)
    dt = c.precise()
    attn = c.build(dtype=dt)
    q, k, v = c.inputs(c.L, c.L, dt)
    sel = (torch.arange(c.B, device=c.device) == 1)[:, None, None, None]
    q2, k2, v2 = (_perturb(t, sel, seed=900 + i) for i, t in enumerate((q, k, v)))
    for causal in c.causal_modes():
        case = _case(causal=causal, L=c.L, S=c.L, dtype=_DTYPE_NAMES[dt])
        base = c.call(attn, case, q, k, v, causal=causal)
        out = c.call(attn, case, q2, k2, v2, causal=causal)
        c.close(out[0], base[0], f"{case}: perturbing batch element 1 changed the output of batch element 0",
                dtype=dt, against="unperturbed")


def _reference_cases(c: _Ctx, dt: torch.dtype) -> list[tuple[str, int, int, dict[str, Any]]]:
    caps = c.caps
    dname = _DTYPE_NAMES[dt]
    out: list[tuple[str, int, int, dict[str, Any]]] = []
    for causal in c.causal_modes():
        out.append((_case(causal=causal), c.L, c.L, {"causal": causal}))
        if caps.key_padding_mask:
            out.append((_case(causal=causal, key_padding_mask="<padded>"), c.L, c.L,
                        {"causal": causal, "key_padding_mask": _padding_mask(c.B, c.L, c.device)}))
        if caps.attn_mask:
            out.append((_case(causal=causal, attn_mask="<bool parity (B, H, L, S)>"), c.L, c.L,
                        {"causal": causal, "attn_mask": _parity_mask(c.B, c.H, c.L, c.L, c.device)}))
            bias = _noise_like(torch.empty(c.B, 1, c.L, c.L, dtype=dt, device=c.device), 1000, 1.0)
            out.append((_case(causal=causal, attn_mask=f"<additive {dname} bias (B, 1, L, S)>"), c.L, c.L,
                        {"causal": causal, "attn_mask": bias}))
            if caps.key_padding_mask:
                out.append((_case(causal=causal, key_padding_mask="<padded>", attn_mask="<additive bias>"),
                            c.L, c.L, {"causal": causal, "attn_mask": bias,
                                       "key_padding_mask": _padding_mask(c.B, c.L, c.device)}))
    for L, S in ((c.L, c.S), (c.S, c.L)):
        if caps.cross and caps.noncausal:
            out.append((_case(causal=False), L, S, {"causal": False}))
            if caps.key_padding_mask:
                out.append((_case(causal=False, key_padding_mask="<padded>"), L, S,
                            {"causal": False, "key_padding_mask": _padding_mask(c.B, S, c.device)}))
        if caps.causal_cross:
            out.append((_case(causal=True), L, S, {"causal": True}))
    return out


def check_reference(cfg: ConformanceConfig) -> None:
    """An exact implementation (``spec.exact``) matches the float64 reference within per-dtype tolerances.

    Reference: :func:`attnkit.reference.reference_attention` on the same
    (cast) inputs. Cases, as declared: causal modes, key padding, bool and
    additive ``attn_mask``, cross (L < S and L > S), causal cross, and a
    non-default ``scale`` when the factory takes one.
    """
    c = _Ctx("reference", cfg)
    if not c.spec.exact:
        c.skip("the spec is not exact (exact=False); approximations are held to 'error_bound'")
    scale = 0.37 if "scale" in c._takes and "scale" not in cfg.options else None
    for dt in c.dtypes():
        dname = _DTYPE_NAMES[dt]
        attn = c.build(dtype=dt)
        cases = _reference_cases(c, dt)
        for n, (label, L, S, kw) in enumerate(cases):
            q, k, v = c.inputs(L, S, dt, seed_offset=n)
            case = f"{label}, L={L}, S={S}, dtype={dname}"
            out = c.call(attn, case, q, k, v, **kw)
            c.close(out, reference_attention(q, k, v, **kw), case, dtype=dt, against="float64 reference")
        if scale is not None:
            scaled = c.build(dtype=dt, scale=scale)
            kw = {"causal": c.causal_modes()[0]}
            q, k, v = c.inputs(c.L, c.L, dt, seed_offset=99)
            case = f"built with scale={scale}, {_case(**kw)}, dtype={dname}"
            out = c.call(scaled, case, q, k, v, **kw)
            c.close(out, reference_attention(q, k, v, scale=scale, **kw), case, dtype=dt,
                    against="float64 reference")


def check_error_bound(cfg: ConformanceConfig) -> None:
    """An approximation stays within ``spec.error_bound`` on the stated distribution.

    See :class:`ErrorDistribution` (default: q, k, v i.i.d. N(0, 1), B=2, H=2,
    L=S=64, D=E=16, seed 0, float32; default options plus the configured ones;
    relative Frobenius error of the whole output against float64 softmax
    attention), for each declared causal mode.
    """
    c = _Ctx("error_bound", cfg)
    spec = c.spec
    if spec.exact:
        c.skip("the spec is exact; it is held to the float64 reference by 'reference'")
    if spec.error_bound is None:
        c.skip("the spec declares no error_bound (error_bound=None: it claims no bound against softmax attention)")
    dist = cfg.error_distribution
    dname = dist.dtype if dist.dtype in c.caps.dtypes else _DTYPE_NAMES[c.precise()]
    dt = DTYPES[dname]
    attn = c.build(dtype=dt, heads=dist.heads, head_dim=dist.dim, seed=dist.seed)
    q, k, v = make_inputs(dist.batch, dist.heads, dist.length, dist.length, dist.dim, dist.dim, dtype=dt,
                          device=c.device, seed=dist.seed, std=dist.std)
    for causal in c.causal_modes():
        case = f"causal={causal}, {dist.describe(dname)}"
        out = c.call(attn, case, q, k, v, causal=causal)
        c.finite(out, case, "output")
        ref = reference_attention(q, k, v, causal=causal)
        err = (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()
        if not err <= spec.error_bound:
            c.fail(f"{case}: relative Frobenius error {err:.4g} vs float64 softmax attention exceeds the "
                   f"declared error_bound {spec.error_bound:g} (options {dict(cfg.options)})")


def check_streaming(cfg: ConformanceConfig) -> None:
    """Streaming through ``init_state``/``step`` in chunks of 1, 3 and the whole sequence.

    ``streaming="exact"``: the concatenated step outputs equal
    ``forward(..., causal=True)`` on the whole sequence, every tested dtype.
    ``"segment"``: shapes and finiteness, and equality with the configured
    ``streaming_reference`` when one is given.
    """
    c = _Ctx("streaming", cfg)
    kind = c.caps.streaming
    if kind is None:
        c.skip("the spec declares no streaming (its refusal is tested by 'refusals')")
    B, L = c.B, c.L
    for dt in c.dtypes():
        dname = _DTYPE_NAMES[dt]
        attn = c.build(dtype=dt)
        q, k, v = c.inputs(L, L, dt)
        full = None
        if kind == "exact":
            full = c.call(attn, _case(causal=True, L=L, S=L, dtype=dname), q, k, v, causal=True)
        for chunk in cfg.streaming_chunks:
            size = L if chunk is None else chunk
            label = f"streaming={kind!r}, chunk={size}{' (whole sequence)' if chunk is None else ''}, " \
                    f"L={L}, dtype={dname}"
            try:
                with torch.no_grad():
                    state = attn.init_state(B, device=c.device, dtype=dt)
                    outs = []
                    for start in range(0, L, size):
                        end = min(L, start + size)
                        o, state = attn.step(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], state)
                        if not isinstance(o, Tensor) or tuple(o.shape) != (B, c.H, end - start, c.E):
                            got = tuple(o.shape) if isinstance(o, Tensor) else type(o).__name__
                            c.fail(f"{label}: step on positions {start}..{end - 1} returned {got}, expected "
                                   f"(B, H, T, E) = {(B, c.H, end - start, c.E)}")
                        outs.append(o)
            except CheckFailed:
                raise
            except Exception as exc:  # noqa: BLE001
                c.fail(f"{label}: init_state/step raised {type(exc).__name__}: {exc}")
            got = torch.cat(outs, dim=2)
            c.finite(got, label, "concatenated step outputs")
            if full is not None:
                atol, rtol = c.tol(dt, 1.0 if dt in (torch.float32, torch.float64) else 2.0)
                c.close(got, full, f"{label}: concatenated step outputs differ from forward(causal=True)",
                        dtype=dt, atol=atol, rtol=rtol, against="parallel causal forward")
            elif cfg.streaming_reference is not None:
                expected = cfg.streaming_reference(attn, q, k, v, size)
                if expected is not None:
                    c.close(got, expected, f"{label}: step outputs differ from the streaming_reference",
                            dtype=dt, against="streaming_reference")


def check_backends(cfg: ConformanceConfig) -> None:
    """Every declared backend that can run here agrees with the ``torch`` path, forward and backward.

    Each backend is forced with ``backend=NAME`` (availability from
    :func:`attnkit.backends.why_unavailable` with ``forced=True``: triton on
    CPU only under ``TRITON_INTERPRET=1``); the torch instance's state_dict is
    loaded into it. Forward in every tested dtype over the declared cases;
    gradients of q, k, v in float32/float64 unless the backend is forward-only.
    Skipped when only ``torch`` is declared or none of the others can run.
    """
    c = _Ctx("backends", cfg)
    others = [b for b in c.caps.backends if b != "torch"]
    if not others:
        c.skip("the spec declares only the torch backend")
    if "backend" not in c._takes:
        c.fail(f"the spec declares backends {list(c.caps.backends)}, but its factory takes no backend= "
               "option, so they cannot be forced (pass backend through to attnkit.Attention.__init__)")
    unavailable = []
    ran = []
    for backend in others:
        reason = why_unavailable(backend, c.device, forced=True)
        if reason is not None:
            unavailable.append(f"{backend}: {reason}")
            continue
        ran.append(backend)
        for dt in c.dtypes():
            dname = _DTYPE_NAMES[dt]
            ref_attn = c.build(dtype=dt, backend="torch")
            attn = c.build(dtype=dt, backend=backend)
            attn.load_state_dict(ref_attn.state_dict())
            factor = 1.0 if dt in (torch.float32, torch.float64) else 2.0
            with_grad = dt in c.float_dtypes() and backend not in c.caps.forward_only_backends
            for n, (label, L, S, kw) in enumerate(_reference_cases(c, dt)):
                case = f"backend={backend!r} vs 'torch', {label}, L={L}, S={S}, dtype={dname}"
                q, k, v = c.inputs(L, S, dt, seed_offset=n, requires_grad=with_grad)
                want = c.call(ref_attn, case, q, k, v, grad=with_grad, **kw)
                got = c.call(attn, case, q, k, v, grad=with_grad, **kw)
                atol, rtol = c.tol(dt, factor)
                c.close(got, want, case, dtype=dt, atol=atol, rtol=rtol, against="torch backend")
                if with_grad:
                    g_want = _grads(ref_attn, want, (q, k, v), seed=1100 + n)
                    g_got = _grads(attn, got, (q, k, v), seed=1100 + n)
                    for name, a, b in zip(("q", "k", "v"), g_got, g_want):
                        if (a is None) != (b is None):
                            c.fail(f"{case}: the gradient of {name} is "
                                   f"{'missing' if a is None else 'present'} on {backend!r} but "
                                   f"{'missing' if b is None else 'present'} on 'torch'")
                        if a is not None:
                            c.close(a, b, case, dtype=dt, what=f"gradient of {name}", atol=atol * 10,
                                    rtol=rtol * 10, against="torch backend")
    if not ran:
        c.skip("no backend besides torch can run here: " + "; ".join(unavailable))


def check_gradients(cfg: ConformanceConfig) -> None:
    """Gradients of q, k, v and parameters are finite; padded keys get zero gradient.

    float32 and float64 (as tested), every declared causal mode, with key
    padding (k and v of padded keys must get exactly-zero gradients, within
    atol), with a bool ``attn_mask`` and cross-attention when declared.
    """
    c = _Ctx("gradients", cfg)
    for dt in c.float_dtypes():
        dname = _DTYPE_NAMES[dt]
        attn = c.build(dtype=dt)
        atol, _ = c.tol(dt)
        setups: list[tuple[str, int, int, dict[str, Any]]] = []
        for causal in c.causal_modes():
            setups.append((_case(causal=causal), c.L, c.L, {"causal": causal}))
            if c.caps.key_padding_mask:
                setups.append((_case(causal=causal, key_padding_mask="<padded>"), c.L, c.L,
                               {"causal": causal, "key_padding_mask": _padding_mask(c.B, c.L, c.device)}))
            if c.caps.attn_mask:
                setups.append((_case(causal=causal, attn_mask="<bool parity>"), c.L, c.L,
                               {"causal": causal, "attn_mask": _parity_mask(c.B, c.H, c.L, c.L, c.device)}))
        if c.caps.cross and c.caps.noncausal:
            setups.append((_case(causal=False), c.L, c.S, {"causal": False}))
        names = ["q", "k", "v"] + [f"parameter {p}" for p, t in attn.named_parameters() if t.requires_grad]
        for n, (label, L, S, kw) in enumerate(setups):
            case = f"{label}, L={L}, S={S}, dtype={dname}"
            q, k, v = c.inputs(L, S, dt, seed_offset=n, requires_grad=True)
            out = c.call(attn, case, q, k, v, grad=True, **kw)
            try:
                grads = _grads(attn, out, (q, k, v), seed=1200 + n)
            except Exception as exc:  # noqa: BLE001
                c.fail(f"{case}: backward raised {type(exc).__name__}: {exc}")
            if grads[2] is None:
                c.fail(f"{case}: the output has no gradient with respect to v")
            for name, g in zip(names, grads):
                c.finite(g, case, f"gradient of {name}")
            kpm = kw.get("key_padding_mask")
            if kpm is not None:
                pad = ~kpm[:, None, :, None]
                for name, g in (("k", grads[1]), ("v", grads[2])):
                    if g is None:
                        continue
                    leak = g.detach().abs().masked_select(pad.expand_as(g))
                    if leak.numel() and not leak.max().item() <= atol:
                        c.fail(f"{case}: the gradient of {name} at padded key positions must be 0, got max "
                               f"|grad| = {leak.max().item():.3g} (tolerance {atol:.3g})")


def check_gradcheck(cfg: ConformanceConfig) -> None:
    """:func:`torch.autograd.gradcheck` passes in float64 on tiny shapes.

    Shapes: ``gradcheck_shapes`` (default ``shapes`` with B = 1); with respect
    to q, k, v; ``fast_mode=True``, eps 1e-6, atol 1e-5, rtol 1e-3. Run on the
    ``torch`` backend and, when different, the backend automatic dispatch picks
    for float64 inputs that need a gradient. Cases: causal modes, key padding,
    bool ``attn_mask``, cross, causal cross, as declared.
    """
    c = _Ctx("gradcheck", cfg)
    if "float64" not in c.caps.dtypes:
        c.skip("the spec does not declare float64, which gradcheck needs")
    dt = torch.float64
    B, H, L, S, D, E = cfg.gradcheck_shapes or (1, *cfg.shapes[1:])
    auto = c.build(dtype=dt)
    probe = make_inputs(B, H, L, L, D, E, dtype=dt, device=c.device, requires_grad=True)
    with torch.enable_grad():
        try:
            resolved = auto.resolve_backend(*probe)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"resolving the automatic backend for float64 inputs that need a gradient raised "
                   f"{type(exc).__name__}: {exc}")
    backends = ["torch"] + ([resolved] if resolved != "torch" else [])
    setups: list[tuple[str, int, int, dict[str, Any]]] = []
    for causal in c.causal_modes():
        setups.append((_case(causal=causal), L, L, {"causal": causal}))
        if c.caps.key_padding_mask:
            setups.append((_case(causal=causal, key_padding_mask="<padded>"), L, L,
                           {"causal": causal, "key_padding_mask": _padding_mask(B, L, c.device)}))
        if c.caps.attn_mask:
            setups.append((_case(causal=causal, attn_mask="<bool parity>"), L, L,
                           {"causal": causal, "attn_mask": _parity_mask(B, H, L, L, c.device)}))
    if c.caps.cross and c.caps.noncausal:
        setups.append((_case(causal=False), L, S, {"causal": False}))
    if c.caps.causal_cross:
        setups.append((_case(causal=True), L, S, {"causal": True}))
    for backend in backends:
        attn = c.build(dtype=dt, **({"backend": backend} if "backend" in c._takes else {}))
        for n, (label, Lq, Sk, kw) in enumerate(setups):
            case = f"backend={backend!r}, {label}, B={B}, H={H}, L={Lq}, S={Sk}, D={D}, E={E}, float64"
            q, k, v = make_inputs(B, H, Lq, Sk, D, E, dtype=dt, device=c.device,
                                  seed=cfg.seed * 1000 + 1300 + n, requires_grad=True)

            def fn(q: Tensor, k: Tensor, v: Tensor, attn: Any = attn, kw: dict[str, Any] = kw) -> Tensor:
                return attn(q, k, v, **kw)

            try:
                torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True)
            except Exception as exc:  # noqa: BLE001 - GradcheckError or the implementation's own
                msg = str(exc)
                c.fail(f"{case}: gradcheck (inputs: 0 = q, 1 = k, 2 = v) failed ({type(exc).__name__}): "
                       f"{msg[:1500]}{' ...' if len(msg) > 1500 else ''}")


def check_state_dict(cfg: ConformanceConfig) -> None:
    """``state_dict`` round-trips: load it (via ``torch.save``/``torch.load(weights_only=True)``)
    into an instance built under another seed with the same options; outputs are equal.

    Random features must live in buffers for this to hold.
    """
    c = _Ctx("state_dict", cfg)
    dt = c.precise()
    a = c.build(dtype=dt, seed=cfg.seed)
    b = c.build(dtype=dt, seed=cfg.seed + 1)
    buf = io.BytesIO()
    try:
        torch.save(a.state_dict(), buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        b.load_state_dict(state)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"saving and loading the state_dict raised {type(exc).__name__}: {exc}")
    same = c.device.type == "cpu"
    setups = [{"causal": causal} for causal in c.causal_modes()]
    if c.caps.key_padding_mask:
        setups.append({"causal": c.causal_modes()[0], "key_padding_mask": _padding_mask(c.B, c.L, c.device)})
    for n, kw in enumerate(setups):
        q, k, v = c.inputs(c.L, c.L, dt, seed_offset=n)
        case = f"{_describe_kwargs(kw)}, dtype={_DTYPE_NAMES[dt]}"
        want, got = c.call(a, case, q, k, v, **kw), c.call(b, case, q, k, v, **kw)
        c.close(got, want, f"{case}: an instance built with another seed and loaded from the state_dict "
                "disagrees with the original (is some state, e.g. random features, not a buffer?)",
                dtype=dt, atol=0.0 if same else None, rtol=0.0 if same else None, against="original")


def check_determinism(cfg: ConformanceConfig) -> None:
    """Determinism under a seed: two instances built after ``torch.manual_seed(seed)`` give identical
    outputs, and one instance called twice in eval mode gives identical outputs (exactly, on CPU)."""
    c = _Ctx("determinism", cfg)
    dt = c.precise()
    a1 = c.build(dtype=dt, seed=cfg.seed)
    a2 = c.build(dtype=dt, seed=cfg.seed)
    exact = c.device.type == "cpu"
    tol = {"atol": 0.0, "rtol": 0.0} if exact else {}
    q, k, v = c.inputs(c.L, c.L, dt)
    for causal in c.causal_modes():
        case = _case(causal=causal, dtype=_DTYPE_NAMES[dt])
        first = c.call(a1, case, q, k, v, causal=causal)
        torch.rand(3)  # advance the global RNG between calls
        again = c.call(a1, case, q, k, v, causal=causal)
        c.close(again, first, f"{case}: the same instance gave a different output on a second call "
                "(eval mode)", dtype=dt, against="first call", **tol)
        other = c.call(a2, case, q, k, v, causal=causal)
        c.close(other, first, f"{case}: two instances built after torch.manual_seed({cfg.seed}) disagree",
                dtype=dt, against="first instance", **tol)


#: Every check, in the order they run; the keys are the names used by ``skip``
#: and reports, and the pytest suite has one ``test_<name>`` method per key.
CHECKS: dict[str, Callable[[ConformanceConfig], None]] = {
    name: _isolated(fn) for name, fn in (
        ("shapes_dtypes", check_shapes_dtypes),
        ("refusals", check_refusals),
        ("causality", check_causality),
        ("key_padding", check_key_padding),
        ("fully_masked_rows", check_fully_masked_rows),
        ("attn_mask", check_attn_mask),
        ("cross_attention", check_cross_attention),
        ("batch_independence", check_batch_independence),
        ("reference", check_reference),
        ("error_bound", check_error_bound),
        ("streaming", check_streaming),
        ("backends", check_backends),
        ("gradients", check_gradients),
        ("gradcheck", check_gradcheck),
        ("state_dict", check_state_dict),
        ("determinism", check_determinism),
    )
}


# ================================================================ running
@dataclass
class CheckResult:
    """One check's outcome: ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``."""

    check: str
    status: str
    message: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ConformanceReport:
    """Per-check results of :func:`run_conformance` for one implementation."""

    name: str
    options: dict[str, Any]
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks do not count against it)."""
        return not self.failed

    @property
    def passed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "passed"]

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def skipped(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "skipped"]

    def __getitem__(self, check: str) -> CheckResult:
        for r in self.results:
            if r.check == check:
                return r
        raise KeyError(f"no result for check {check!r}; checks: {[r.check for r in self.results]}")

    def summary(self) -> str:
        secs = sum(r.seconds for r in self.results)
        opts = f" {self.options}" if self.options else ""
        return (f"{self.name}{opts}: {len(self.passed)} passed, {len(self.failed)} failed, "
                f"{len(self.skipped)} skipped ({secs:.1f}s)")

    def format(self) -> str:
        """A human-readable multi-line report."""
        lines = [self.summary()]
        tags = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}
        for r in self.results:
            line = f"  {tags.get(r.status, r.status.upper()):4}  {r.check}"
            if r.message:
                line += f": {r.message}"
            lines.append(line)
        return "\n".join(lines)

    __str__ = format

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "options": {k: (v if isinstance(v, (bool, int, float, str, type(None))) else repr(v))
                        for k, v in self.options.items()},
            "ok": self.ok,
            "passed": len(self.passed),
            "failed": len(self.failed),
            "skipped": len(self.skipped),
            "checks": [r.as_dict() for r in self.results],
        }


def run_check(check: str, cfg: ConformanceConfig) -> CheckResult:
    """Run one check; never raises for the implementation's faults (they become a failed result)."""
    if check not in CHECKS:
        raise ConformanceConfigError(f"unknown check {check!r}; the checks are {list(CHECKS)}")
    if check in cfg.skip:
        return CheckResult(check, "skipped", f"skipped by configuration: {cfg.skip[check]}")
    t0 = time.perf_counter()
    try:
        CHECKS[check](cfg)
    except CheckSkipped as exc:
        return CheckResult(check, "skipped", str(exc), time.perf_counter() - t0)
    except ConformanceConfigError:
        raise
    except AssertionError as exc:
        return CheckResult(check, "failed", str(exc), time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - an unexpected error is a failure of that check
        return CheckResult(check, "failed", f"raised {type(exc).__name__}: {exc}", time.perf_counter() - t0)
    return CheckResult(check, "passed", "", time.perf_counter() - t0)


def run_conformance(name: str, options: Mapping[str, Any] | None = None, *,
                    checks: Iterable[str] | None = None, **config: Any) -> ConformanceReport:
    """Run the conformance kit on the registered implementation ``name``, without pytest.

    Args:
        name: registered name (alias, ``family/name`` or ``distribution:name``).
        options: extra build options (as for :func:`attnkit.build`).
        checks: names of the checks to run (default: all of :data:`CHECKS`).
        **config: further :class:`ConformanceConfig` fields (``dtypes``,
            ``atol``, ``rtol``, ``shapes``, ``skip``, ``error_distribution``, ...).

    Returns:
        a :class:`ConformanceReport`; ``report.ok`` is False when a check failed.

    Raises:
        UnknownAttentionError, AmbiguousNameError: ``name`` does not resolve.
        ConformanceConfigError: an invalid configuration.
    """
    cfg = ConformanceConfig(name=name, options=dict(options or {}), **config)
    cfg.spec  # noqa: B018 - resolve the name before any work (clear error)
    selected = list(CHECKS) if checks is None else list(checks)
    unknown = [c for c in selected if c not in CHECKS]
    if unknown:
        raise ConformanceConfigError(f"checks: unknown check name(s) {unknown}; the checks are {list(CHECKS)}")
    return ConformanceReport(name, dict(cfg.options), [run_check(c, cfg) for c in selected])
