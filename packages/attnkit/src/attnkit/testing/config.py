"""What the conformance kit checks and how: :class:`ConformanceConfig`, tolerances, outcomes.

Nothing here imports pytest. The checks (``attnkit.testing.<concern>``) take a
:class:`ConformanceConfig` and return (pass, optionally with a note such as a
measured figure), raise :class:`CheckFailed` (an ``AssertionError``) or raise
:class:`CheckSkipped` (with the reason).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..spec import AttentionSpec, Capabilities

if TYPE_CHECKING:  # pragma: no cover
    from ..registry import Registry

__all__ = [
    "DTYPES", "DEFAULT_ATOL", "DEFAULT_RTOL", "DEFAULT_SHAPES", "DEFAULT_STREAMING_CHUNKS",
    "DEFAULT_LONG_LENGTH", "CheckFailed", "CheckSkipped", "ConformanceConfig", "ConformanceConfigError",
    "ErrorDistribution", "dtype_name",
]

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

#: Absolute tolerance per dtype for "equals" comparisons of outputs of
#: magnitude ~1 (against the float64 reference, or between two paths).
DEFAULT_ATOL: dict[str, float] = {"float64": 1e-9, "float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
#: Relative tolerance per dtype (``|actual - expected| <= atol + rtol * |expected|``).
DEFAULT_RTOL: dict[str, float] = {"float64": 1e-7, "float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}

#: Default ``(B, H, L, S, D, E)``: self-attention checks use L queries and L
#: keys; cross-attention checks use L queries and S keys (and S queries, L keys).
#: 9 and 12 are multiples of no block size (8, 16, 64).
DEFAULT_SHAPES: tuple[int, int, int, int, int, int] = (2, 2, 9, 12, 8, 6)
#: Streaming chunk sizes; None = the whole sequence in one step.
DEFAULT_STREAMING_CHUNKS: tuple[int | None, ...] = (1, 3, None)
#: One self-attention length longer than a 64-block and a multiple of none (ragged last blocks).
DEFAULT_LONG_LENGTH = 67


class CheckFailed(AssertionError):
    """A conformance check found a violation of the contract."""


class CheckSkipped(Exception):
    """A check does not apply to this implementation; the message is the reason."""


class ConformanceConfigError(ValueError):
    """The conformance configuration itself is invalid (a typo in ``skip``, a bad shape)."""


def dtype_name(d: str | torch.dtype) -> str:
    """``"float32"`` for ``torch.float32`` or ``"float32"``; ConformanceConfigError otherwise."""
    if isinstance(d, torch.dtype):
        if d not in DTYPE_NAMES:
            raise ConformanceConfigError(f"unsupported dtype {d}; use one of {list(DTYPES)}")
        return DTYPE_NAMES[d]
    name = str(d).removeprefix("torch.")
    if name not in DTYPES:
        raise ConformanceConfigError(f"unsupported dtype {d!r}; use one of {list(DTYPES)}")
    return name


@dataclass(frozen=True)
class ErrorDistribution:
    """The stated input distribution of the ``error_bound`` check (the "error vs softmax" figure).

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


@dataclass
class ConformanceConfig:
    """What to check and how.

    Attributes:
        name: registered name (alias, ``family/name`` or ``distribution:name``).
        options: extra build options; ``num_heads``/``head_dim`` are added from
            the shapes when the factory takes them and they are not given here.
        dtypes: dtypes to test (names or torch dtypes); None = every dtype the
            spec declares. Must be a subset of the declared ones.
        atol, rtol: per-dtype overrides of :data:`DEFAULT_ATOL` / :data:`DEFAULT_RTOL`
            (they also loosen the ``reference`` check, e.g. ``atol={"float64": 1e-7}``).
        shapes: ``(B, H, L, S, D, E)``; B >= 2, L >= 4, S >= 2, S != L.
        gradcheck_shapes: ``(B, H, L, S, D, E)`` for ``gradcheck``; None =
            ``shapes`` with B = 1.
        long_length: one longer self-attention length for the ``reference``
            and ``backends`` cases (ragged last blocks); None leaves it out.
        error_distribution: see :class:`ErrorDistribution`.
        streaming_chunks: chunk sizes for the streaming check (None = whole sequence).
        streaming_reference: for ``streaming="segment"``, an optional callable
            ``(attn, q, k, v, chunk) -> Tensor (B, H, L, E) or None`` giving
            the expected concatenated step outputs.
        queries_interact: the mechanism lets queries influence each other's
            outputs (a NaN query may then spread); skips ``nan_queries``.
        skip: ``{check_name: reason}``; the reasons are reported.
        device: where tensors and modules live.
        seed: seeds module construction and inputs.
        registry: the :class:`attnkit.registry.Registry` to resolve and build
            ``name`` from; None = the default registry.
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    dtypes: Sequence[str | torch.dtype] | None = None
    atol: Mapping[str | torch.dtype, float] = field(default_factory=dict)
    rtol: Mapping[str | torch.dtype, float] = field(default_factory=dict)
    shapes: Sequence[int] = DEFAULT_SHAPES
    gradcheck_shapes: Sequence[int] | None = None
    long_length: int | None = DEFAULT_LONG_LENGTH
    error_distribution: ErrorDistribution = field(default_factory=ErrorDistribution)
    streaming_chunks: Sequence[int | None] = DEFAULT_STREAMING_CHUNKS
    streaming_reference: Callable[..., Tensor | None] | None = None
    queries_interact: bool = False
    skip: Mapping[str, str] = field(default_factory=dict)
    device: str | torch.device = "cpu"
    seed: int = 0
    registry: Registry | None = None

    def __post_init__(self) -> None:
        from ..registry import default_registry
        from .checks import CHECKS

        if not isinstance(self.name, str) or not self.name:
            raise ConformanceConfigError(
                f"name: expected the registered name of the implementation to check, got {self.name!r}"
            )
        if self.registry is None:
            self.registry = default_registry()
        self.options = dict(self.options or {})
        self.shapes = check_shapes("shapes", self.shapes)
        if self.gradcheck_shapes is not None:
            self.gradcheck_shapes = check_shapes("gradcheck_shapes", self.gradcheck_shapes, min_batch=1)
        if self.long_length is not None and (isinstance(self.long_length, bool)
                                             or not isinstance(self.long_length, int) or self.long_length < 1):
            raise ConformanceConfigError(f"long_length: expected a positive int or None, got {self.long_length!r}")
        unknown = set(self.skip) - set(CHECKS)
        if unknown:
            raise ConformanceConfigError(
                f"skip: unknown check name(s) {sorted(unknown)}; the checks are {list(CHECKS)}"
            )
        if isinstance(self.error_distribution, Mapping):
            self.error_distribution = ErrorDistribution(**self.error_distribution)
        dtype_name(self.error_distribution.dtype)
        self.atol = {**DEFAULT_ATOL, **{dtype_name(k): float(v) for k, v in self.atol.items()}}
        self.rtol = {**DEFAULT_RTOL, **{dtype_name(k): float(v) for k, v in self.rtol.items()}}
        self.device = torch.device(self.device)
        for c in self.streaming_chunks:
            if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
                raise ConformanceConfigError(f"streaming_chunks: expected positive ints or None, got {c!r}")
        self.queries_interact = bool(self.queries_interact)
        self._spec: AttentionSpec | None = None

    # -- derived ------------------------------------------------------------
    @property
    def spec(self) -> AttentionSpec:
        if self._spec is None:
            self._spec = self.registry.resolve(self.name)
        return self._spec

    @property
    def caps(self) -> Capabilities:
        return self.spec.capabilities

    def tested_dtypes(self) -> list[str]:
        """Dtype names to test: the configured ones, else every declared one."""
        declared = list(self.caps.dtypes)
        if self.dtypes is None:
            return declared
        names = [dtype_name(d) for d in self.dtypes]
        extra = [n for n in names if n not in declared]
        if extra:
            raise ConformanceConfigError(
                f"dtypes_to_test: {extra} not declared by {self.spec.name!r} (declares {declared}); "
                "an undeclared dtype must be refused, which the 'refusals' check tests"
            )
        return names

    def tol(self, dtype: str | torch.dtype) -> tuple[float, float]:
        name = dtype_name(dtype)
        return self.atol[name], self.rtol[name]


def check_shapes(what: str, shapes: Sequence[int], *, min_batch: int = 2) -> tuple[int, ...]:
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
