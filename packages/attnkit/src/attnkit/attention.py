"""The contract: :class:`Attention`, the base class of every implementation (contract version 2)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from . import amp as _amp
from . import aux as _aux
from . import backends as _backends
from . import caching as _caching
from . import masks as _masks
from . import reset as _reset
from . import transforms as _transforms
from .aux import AuxLossMixin
from .context import CallContext
from .errors import InvalidInputError, UnsupportedFeatureError
from .positions import Positions, as_positions
from .spec import AttentionSpec, Capabilities
from .state import AttentionState

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}

#: how each mask kind is named in a refusal, and the capability filter that finds who honours it
_KIND_ARGUMENT = {
    "causal": "causal=True",
    "key_padding": "key_padding_mask",
    "tensor": "attn_mask",
    "sliding_window": "a sliding_window mask",
    "document": "a document mask (packed sequences)",
    "function": "a mask function (attnkit.masks.from_function)",
    "union": "a union of masks (|)",
}


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"[:120]


# The registry depends on this module, not the other way round: it hands its
# process-wide instance in here when it is imported (dependency injection keeps
# the import graph acyclic).
_REGISTRY_PROVIDER: list[Any] = []


def set_registry_provider(provider: Any) -> None:
    """Called by :mod:`attnkit.registry`: ``provider()`` returns the process-wide registry."""
    _REGISTRY_PROVIDER[:] = [provider]


def registry_or_none() -> Any:
    """The process-wide registry, or None before :mod:`attnkit.registry` is imported."""
    return _REGISTRY_PROVIDER[0]() if _REGISTRY_PROVIDER else None


@dataclass(frozen=True)
class Limits:
    """Length limits of one instance (they may depend on its options).

    Attributes:
        max_length: the longest L and S accepted (None: no limit).
        equal_length: L must equal S.
        length_multiple: L and S must be multiples of it (None: any).
    """

    max_length: int | None = None
    equal_length: bool = False
    length_multiple: int | None = None

    def why_not(self, L: int, S: int) -> str | None:
        """None when ``(L, S)`` is accepted, else the limit that refuses it."""
        if self.max_length is not None and max(L, S) > self.max_length:
            return f"max_length {self.max_length}"
        if self.equal_length and L != S:
            return "L must equal S"
        m = self.length_multiple
        if m is not None and (L % m or S % m):
            return f"lengths must be multiples of {m}"
        return None


@dataclass(frozen=True)
class ShortestLengths(Limits):
    """An instance's limits (``base``) with a shortest non-empty length: ``0 < L < min_queries`` or
    ``0 < S < min_keys`` is refused too (``reason`` says why: a window, a landmark count or a global position of
    the options that does not fit), as ``max_length`` refuses longer ones; empty sequences stay accepted (empty
    in, empty or zeros out). The fields of :class:`Limits` are ``base``'s (:func:`shortest_lengths` makes one).

    While ``torch.export`` traces a dynamic length (:func:`attnkit.transforms.symbolic`) the shortest length is
    not asked (a comparison would fix the dimension's range): the module asserts it in the program instead
    (:func:`attnkit.transforms.assert_at_least`), so the program refuses what the eager forward refuses.
    """

    min_queries: int = 1
    min_keys: int = 1
    reason: str = ""
    base: Limits | None = None

    def why_not(self, L: int, S: int) -> str | None:
        why = super().why_not(L, S) if self.base is None else self.base.why_not(L, S)
        if why is not None or _transforms.symbolic(L, S):
            return why
        if 0 < L < self.min_queries or 0 < S < self.min_keys:
            return self.reason
        return None


def shortest_lengths(base: Limits, reason: str, *, min_queries: int = 1, min_keys: int = 1) -> Limits:
    """``base`` (an instance's other limits) with the shortest lengths of :class:`ShortestLengths`; ``base`` itself
    when both are 1."""
    if min_queries <= 1 and min_keys <= 1:
        return base
    return ShortestLengths(max_length=base.max_length, equal_length=base.equal_length,
                           length_multiple=base.length_multiple, min_queries=min_queries, min_keys=min_keys,
                           reason=reason, base=base)


class Attention(AuxLossMixin, nn.Module):
    """Base class of every attnkit attention implementation.

    Subclasses implement :meth:`_attend` (contract 2: one :class:`CallContext`)
    or, the version-1 spelling still accepted, :meth:`_forward` with
    ``causal``/``key_padding_mask``/``attn_mask``; with the ``streaming``
    capability also :meth:`_init_state` and :meth:`_step`. The public
    :meth:`forward` and :meth:`step` validate inputs once, resolve the mask,
    positions, backend and state once, and refuse with
    :class:`~attnkit.errors.UnsupportedFeatureError` anything the
    capabilities leave out, so nothing is ever ignored silently.

    Args:
        num_heads: number of heads H; when given, inputs must have H heads.
        head_dim: head dimension D; when given, q and k must have it.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``. Finite and > 0.
        backend: ``"auto"`` picks a backend for the tensors' device (measured
            winners from ``attnkit tune`` where present); a name forces it.
    """

    #: Capabilities used when the class is not registered (the spec wins).
    capabilities: ClassVar[Capabilities | None] = None

    #: Why this implementation refuses an argument, keyed by capability name
    #: (``"attn_mask"``, ``"causal"``, ``"cross"``, ...); shown in the
    #: :class:`~attnkit.errors.UnsupportedFeatureError` instead of the generic reason.
    refusal_reasons: ClassVar[Mapping[str, str]] = {}

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto") -> None:
        super().__init__()
        for arg, value in (("num_heads", num_heads), ("head_dim", head_dim)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidInputError(f"{arg}: expected a positive int or None, got {value!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not (float(scale) > 0 and float(scale) < float("inf"))):
            raise InvalidInputError(f"scale: expected a finite float > 0 or None, got {scale!r}")
        if not isinstance(backend, str):
            raise InvalidInputError(f"backend: expected a backend name or 'auto', got {backend!r}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = None if scale is None else float(scale)
        self.backend = backend
        self._attnkit_spec: AttentionSpec | None = None
        self._backend_cache: dict[tuple[Any, ...], str] = {}

    # ------------------------------------------------------------------ spec
    @property
    def spec(self) -> AttentionSpec | None:
        """The registered spec (set by :func:`attnkit.build`, else looked up by class)."""
        if self._attnkit_spec is None:
            reg = registry_or_none()
            self._attnkit_spec = reg.spec_for_class(type(self)) if reg is not None else None
        return self._attnkit_spec

    @spec.setter
    def spec(self, value: AttentionSpec | None) -> None:
        self._attnkit_spec = value
        self.__dict__["_backend_cache"] = {}

    @property
    def caps(self) -> Capabilities:
        """The capabilities this instance honours."""
        spec = self.spec
        if spec is not None:
            return spec.capabilities
        return type(self).capabilities or Capabilities()

    @property
    def limits(self) -> Limits:
        """Length limits of this instance; subclasses whose options fix a length override it."""
        c = self.caps
        return Limits(max_length=c.max_length, equal_length=not (c.cross or c.causal_cross),
                      length_multiple=c.length_multiple)

    @property
    def impl_name(self) -> str:
        spec = self.spec
        return spec.name if spec is not None else type(self).__name__

    def extra_repr(self) -> str:
        parts = [f"name={self.impl_name!r}"]
        if self.num_heads is not None:
            parts.append(f"num_heads={self.num_heads}")
        if self.head_dim is not None:
            parts.append(f"head_dim={self.head_dim}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

    def reset_parameters(self) -> None:
        """Initialise every parameter and buffer (submodules' too) as ``attnkit.build`` with this module's options
        does, in place, each keeping its device and dtype.

        The meta-device recipe: build under ``torch.device("meta")``, ``module.to_empty(device=...)``, then
        ``reset_parameters()`` on each module that has one (FSDP's default ``param_init_fn``). Options with a
        ``seed`` give the same values as a build; others draw from the global RNG, as ``nn.Linear`` does.

        Raises:
            InvalidInputError: the module holds parameters or buffers of its own and was not built by
                ``attnkit.build`` (its options are unknown; without own tensors its children's
                ``reset_parameters()`` run).
        """
        _reset.reset_from_build(self, _reset.build_maker(self.spec, self.__dict__.get("build_options")),
                                repr(self.impl_name))

    def get_scale(self, q: Tensor) -> float:
        """``scale`` if given, else ``1/sqrt(D)`` for queries ``q`` of shape (..., D)."""
        return self.scale if self.scale is not None else q.shape[-1] ** -0.5

    def _needs_grad(self, *tensors: Tensor) -> bool:
        return torch.is_grad_enabled() and (
            any(t.requires_grad for t in tensors) or any(p.requires_grad for p in self.parameters()))

    def resolve_backend(self, *tensors: Tensor, needs_grad: bool | None = None) -> str:
        """The backend to run for these tensors, cached per device, dtype, gradient need and length.

        Raises:
            InvalidInputError: a backend the implementation does not offer.
            BackendUnavailableError: a forced backend that cannot run here.
        """
        t0 = tensors[0]
        if needs_grad is None:
            needs_grad = self._needs_grad(*tensors)
        if torch.compiler.is_compiling():
            return self._backend_while_compiling(t0.device, needs_grad, t0.dtype)
        length = t0.shape[-2] if t0.dim() >= 2 else 0
        env = os.environ.get(_backends.ENV_BACKEND, "")
        key = (t0.device, t0.dtype, needs_grad, env, int(length).bit_length(), _tuning_generation(),
               self.backend)   # the attribute may be set after a call: attn.backend = "torch" switches
        cache = self.__dict__.setdefault("_backend_cache", {})
        hit = cache.get(key)
        if hit is not None:
            return hit
        caps = self.caps
        backend = _backends.select_backend(
            implementation=self.impl_name,
            offered=self._auto_order(t0.device, t0.dtype),
            forward_only=caps.forward_only_backends,
            requested=self.backend,
            device=t0.device,
            needs_grad=needs_grad,
        )
        if self.backend == "auto" and not env.strip():
            tuned = _tuned_backend(self, t0.device, t0.dtype, needs_grad, int(length))
            if tuned is not None and tuned in caps.backends and _backends.why_unavailable(tuned, t0.device) is None \
                    and not (needs_grad and tuned in caps.forward_only_backends):
                backend = tuned
        cache[key] = backend
        return backend

    def backend_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """The order in which ``backend="auto"`` tries the offered backends for inputs on ``device`` of ``dtype``.

        The default is the declared order, ``caps.backends``. An implementation whose fastest backend depends
        on the dtype (measured: a kernel that is fast in bfloat16 and slow in float32, say) overrides this and
        returns the offered backends in another order; names it does not return keep their declared order after
        the returned ones, and names it does not offer are ignored. A forced backend (``backend=`` or
        ``ATTNKIT_BACKEND``) and a measured winner from ``attnkit tune`` both win over this order.
        """
        return tuple(self.caps.backends)

    def _auto_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        offered = tuple(self.caps.backends)
        first = [b for b in dict.fromkeys(self.backend_order(device, dtype)) if b in offered]
        return (*first, *(b for b in offered if b not in first))

    def _backend_while_compiling(self, device: torch.device, needs_grad: bool,
                                 dtype: torch.dtype | None = None) -> str:
        """The static choice, in plain Python torch.compile can trace (no imports, no environment, no cache)."""
        caps = self.caps
        if self.backend != "auto":
            return self.backend
        runs_on = {"numba": "cpu", "triton": "cuda", "flex": "cuda"}
        for name in (self._auto_order(device, dtype) if dtype is not None else caps.backends):
            if needs_grad and name in caps.forward_only_backends:
                continue
            if runs_on.get(name, device.type) == device.type:
                return name
        return "torch"

    def state_owner(self) -> tuple[str, str]:
        """``(name, configuration)`` identifying which states this module accepts."""
        shapes = ",".join(f"{n}{tuple(t.shape)}" for n, t in self.state_dict().items())
        conf = f"{type(self).__qualname__}; heads={self.num_heads}; head_dim={self.head_dim}; " \
               f"scale={self.scale}; {shapes}"
        return self.impl_name, conf

    def pattern_mask(self, L: int, S: int, *, causal: bool = False) -> _masks.Mask | None:
        """The mechanism's static pattern of allowed (query, key) pairs, as a mask object, or None.

        Sparse patterns (local windows, BigBird, ...) return their
        :class:`attnkit.masks.Mask` for queries of length ``L`` and keys of
        length ``S`` (the causal form with ``causal=True``, the causal
        constraint included); ``attnkit describe NAME --plot FILE`` draws it
        from its block index. The default, None, means no static pattern
        (dense, content-based or kernelized attention).
        """
        return None

    def _transform_backend(self) -> str | None:
        """Under ``torch.func`` transforms ``"torch"`` (None when none is active); refuses a transform the spec does
        not declare (``Capabilities.func_transforms``) and a forced backend other than ``torch``."""
        active = _transforms.active()
        if not active:
            return None
        declared = self.caps.func_transforms

        def what(t: str) -> str:
            return ("forward-mode AD (dual tensors of torch.autograd.forward_ad)"
                    if t == "jvp" and _transforms.in_dual_call() else f"torch.func.{t}")

        for t in active:
            if t not in declared:
                self._refuse(what(t), "its kernels do not compose with torch.func transforms (NumPy or "
                             "numba on tensor data, or custom autograd functions without transform rules)"
                             + (f"; it declares {declared}" if declared else ""), func_transforms=t)
        if self.backend not in ("auto", "torch"):
            raise UnsupportedFeatureError(
                self.impl_name, f"{what(active[0])} with backend={self.backend!r}",
                "only its torch backend composes with torch.func transforms; build it with backend='torch' or "
                "'auto' (which runs torch under a transform)")
        return "torch"

    def _export_backend(self, mask: _masks.Mask | None, q: Tensor, needs_grad: bool) -> str | None:
        """While ``torch.export`` traces, the backend to run (None otherwise): for ``auto`` the first of
        ``Capabilities.export_backends`` in the automatic order that runs on ``q``'s device. Refuses an
        implementation that does not declare ``Capabilities.export``, a mask of the traced inputs whose kind it
        does not declare in ``export_masks``, and a forced backend not in ``export_backends``."""
        if not torch.compiler.is_exporting() or torch.compiler.is_dynamo_compiling():
            return None
        caps = self.caps
        if not caps.export:
            self._refuse("torch.export", "it does not declare that its torch backend exports "
                         "(Capabilities.export)", export=True)
        for leaf in mask.leaves() if mask is not None else ():
            if leaf.kind not in caps.export_masks and _caching.reads_traced(leaf):
                self._refuse(f"a {leaf.kind} mask among the inputs of torch.export",
                             "the mask's values decide sizes or branches in its computation, which an exported "
                             "program cannot take from its inputs; export a module without it, or with the mask "
                             "as a constant" + (f"; it declares export_masks={caps.export_masks}"
                                                if caps.export_masks else ""), export_masks=leaf.kind)
        exportable = caps.export_backends
        if self.backend != "auto":
            if self.backend not in exportable:
                raise UnsupportedFeatureError(
                    self.impl_name, f"torch.export with backend={self.backend!r}",
                    f"an exported program can hold its backends {exportable} (ATen operators or custom "
                    "operators); build it with one of them or 'auto'")
            return self.backend
        for name in self._auto_order(q.device, q.dtype):
            if name not in exportable or (needs_grad and name in caps.forward_only_backends):
                continue
            if _backends.why_unavailable(name, q.device) is None:
                return name
        return "torch"

    # ------------------------------------------------------------ refusals
    def _refuse(self, argument: str, reason: str = "", *, given: str = "", **capability: Any) -> None:
        """Raise UnsupportedFeatureError; ``capability`` finds who supports it, ``refusal_reasons`` may reword."""
        for key in capability:
            reason = type(self).refusal_reasons.get(key, reason)
        if given:
            reason = f"{reason}; {given}" if reason else given
        reg = registry_or_none()
        try:
            supported = [s.name for s in reg.available(**capability)] if capability and reg is not None else []
        except Exception:  # noqa: BLE001 - a registry problem must not hide the refusal
            supported = []
        raise UnsupportedFeatureError(self.impl_name, argument, reason, supported)

    def _check_qkv(self, q: Any, k: Any, v: Any, where: str) -> None:
        for arg, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise InvalidInputError(f"{where}: {arg} must be a torch.Tensor, got {_describe(t)}")
            if t.dim() != 4:
                shape = "(B, H, L, D)" if arg == "q" else "(B, H, S, D)" if arg == "k" else "(B, H, S, E)"
                raise InvalidInputError(
                    f"{where}: {arg} must be 4-D {shape}, got {t.dim()}-D shape {tuple(t.shape)}; "
                    "for (B, L, H*D) inputs use attnkit.MultiHeadAttention or reshape and transpose(1, 2)"
                )
            if not t.is_floating_point():
                raise InvalidInputError(f"{where}: {arg} must be a floating tensor, got dtype {t.dtype}")
        if not (q.device == k.device == v.device):
            raise InvalidInputError(
                f"{where}: q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}"
            )
        if not (q.dtype == k.dtype == v.dtype):
            raise InvalidInputError(
                f"{where}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
            )
        for dim, label in ((0, "batch size B"), (1, "number of heads H")):
            if not (q.shape[dim] == k.shape[dim] == v.shape[dim]):
                raise InvalidInputError(
                    f"{where}: q, k and v must agree on the {label} (dim {dim}), "
                    f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
                )
        if q.shape[-1] != k.shape[-1]:
            raise InvalidInputError(
                f"{where}: q and k must share the head dimension D (last dim), "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if k.shape[2] != v.shape[2]:
            raise InvalidInputError(
                f"{where}: k and v must have the same length S (dim 2), got k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if self.num_heads is not None and q.shape[1] != self.num_heads:
            raise InvalidInputError(
                f"{where}: {self.impl_name!r} was built with num_heads={self.num_heads}, got q with "
                f"H={q.shape[1]} heads (q {tuple(q.shape)}); build it with num_heads={q.shape[1]}")
        if self.head_dim is not None and q.shape[-1] != self.head_dim:
            raise InvalidInputError(
                f"{where}: {self.impl_name!r} was built with head_dim={self.head_dim}, got q and k with "
                f"D={q.shape[-1]} (q {tuple(q.shape)}); build it with head_dim={q.shape[-1]}")
        dname = _DTYPE_NAMES.get(q.dtype, str(q.dtype))
        if dname not in self.caps.dtypes:
            self._refuse(f"dtype {dname}", f"it takes {', '.join(self.caps.dtypes)}", dtypes=dname)

    def _check_mask(self, mask: _masks.Mask | None, L: int, S: int) -> None:
        caps = self.caps
        is_causal = mask is not None and mask.is_causal
        if mask is not None:
            kinds = mask.kinds
            missing = [kd for kd in _masks.MASK_KINDS if kd in kinds and kd not in caps.mask_kinds]
            for kd in missing:
                if kd == "causal":
                    self._refuse("causal=True", "it has no causal form", causal=True)
                if kd == "key_padding":
                    self._refuse("key_padding_mask", "", key_padding_mask=True)
                if kd == "tensor":
                    self._refuse("attn_mask", "use key_padding_mask and causal, or an implementation with attn_mask",
                                 given=f"expected attn_mask=None, got {mask!r}", attn_mask=True)
                self._refuse(_KIND_ARGUMENT.get(kd, f"mask kind {kd!r}"),
                             f"it honours mask kinds {list(caps.mask_kinds) or 'none'}", given=f"got {mask!r}",
                             mask_kinds=kd)
            if "causal" in kinds and not is_causal and "causal" not in missing:
                # causal inside a union: only implementations that materialise masks honour it
                if "union" not in caps.mask_kinds:
                    self._refuse("a union of masks (|)", "", given=f"got {mask!r}", mask_kinds="union")
        if not is_causal and not caps.noncausal:
            self._refuse("causal=False", "it is a causal-only recurrence; pass causal=True", noncausal=True)
        if L != S:
            if is_causal and not caps.causal_cross:
                self._refuse(f"causal=True with L != S (got L={L}, S={S})",
                             "its causal form needs queries and keys of one sequence", causal_cross=True)
            if not is_causal and not caps.cross:
                self._refuse(f"cross-attention (L={L} != S={S})", "", cross=True)

    # --------------------------------------------------------------- forward
    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: _masks.Mask | None = None, causal: bool = False,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
                positions: Positions | Tensor | int | None = None, state: AttentionState | None = None,
                return_state: bool = False) -> Tensor | tuple[Tensor, AttentionState]:
        """Attend queries to keys.

        Args:
            q: queries ``(B, H, L, D)``.
            k: keys ``(B, H, S, D)``.
            v: values ``(B, H, S, E)``.
            mask: an :class:`attnkit.masks.Mask` (causal, padding, sliding
                window, document ids, a mask function, ``&``/``|`` of them).
            causal: shorthand for ``mask & attnkit.masks.causal()``: query
                ``i`` sees keys at positions ``<= i + S - L`` (bottom-right).
            key_padding_mask: shorthand, bool ``(B, S)``, True = a real token.
            attn_mask: shorthand, bool (True = attend) or additive float mask
                broadcastable to ``(B, H, L, S)``.
            positions: None, an int offset, an int tensor ``(L,)``/``(B, L)``
                or :class:`attnkit.Positions` (see :mod:`attnkit.positions`).
            state: a state from :meth:`init_state`, :meth:`step` or a previous
                ``forward(..., return_state=True)``: continue from it.
            return_state: return ``(out, new_state)``; works under autograd
                (segment-by-segment training).

        Returns:
            ``(B, H, L, E)`` in the dtype of ``q`` (fully masked rows are 0;
            a NaN query gives NaN in its own row only), or ``(out, new_state)``.

        Raises:
            InvalidInputError: wrong types, ranks, shapes, dtypes, devices, a
                state from another module, batch, dtype or device.
            UnsupportedFeatureError: an argument or mask kind this
                implementation cannot honour, or a length beyond its limits.
        """
        cast = _amp.autocast_inputs(q, k, v, self.caps.dtypes)
        if cast is not None:   # like SDPA under autocast: inputs cast once, the implementation run with autocast off
            with torch.autocast(q.device.type, enabled=False):
                return self.forward(*cast, mask=mask, causal=causal, key_padding_mask=key_padding_mask,
                                    attn_mask=attn_mask, positions=positions, state=state, return_state=return_state)
        self._check_qkv(q, k, v, "forward")
        B, H, L, _ = q.shape
        S = k.shape[2]
        m = _masks.resolve(mask, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        self._check_mask(m, L, S)
        pos = as_positions(positions, L=L, S=S)
        caps = self.caps
        if pos is not None and not caps.positions:
            self._refuse("positions", "it does not use token positions", given=f"got {pos!r}", positions=True)
        geom = _masks.Geometry(B, H, L, S, q.device, pos)
        if m is not None:
            m.check(geom, "forward")
        why = self.limits.why_not(L, S)
        if why is not None:
            raise UnsupportedFeatureError(self.impl_name, f"sequences of L={L}, S={S}",
                                          f"beyond its limit ({why}) with these options",
                                          instead="Build it with options whose limit fits these lengths")
        if not isinstance(return_state, bool):
            raise InvalidInputError(f"return_state: expected a bool, got {_describe(return_state)}")
        stateful = state is not None or return_state
        owner = None
        if stateful:
            if caps.streaming is None:
                self._refuse("state / return_state", "it keeps no state between calls", streaming=True)
            if caps.streaming == "exact" and not (m is not None and m.is_causal):
                raise InvalidInputError(
                    f"forward: {self.impl_name!r} carries a causal prefix in its state; pass causal=True with "
                    "state= or return_state=True")
            owner = self.state_owner()
            if state is None:
                state = AttentionState(owner, B, q.dtype, q.device, self._init_state(
                    B, device=q.device, dtype=q.dtype))
            elif not isinstance(state, AttentionState):
                raise InvalidInputError(
                    f"forward: state must come from init_state(), step() or forward(return_state=True) of "
                    f"{self.impl_name!r}, got {_describe(state)}")
            else:
                state.validate(owner, q, "forward")
        needs_grad = self._needs_grad(q, k, v)
        if L == 0 or S == 0 or B == 0 or H == 0:   # nothing to attend (an empty batch too, as SDPA)
            out = _empty_output(q, k, v)
            return (out, state.advanced(state.data, L, q)) if return_state else out
        kpm = m.key_padding_mask if m is not None else None
        if kpm is not None:  # padded keys have no influence, whatever they hold (NaN, Inf)
            pad = ~kpm[:, None, :, None]
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
        # dual tensors of torch.autograd.forward_ad: the call runs as under torch.func.jvp (the torch path)
        with _transforms.forward_ad_call(_transforms.dual_inputs(q, k, v, None if state is None else state.data)):
            backend = (self._transform_backend() or self._export_backend(m, q, needs_grad)
                       or self.resolve_backend(q, k, v, needs_grad=needs_grad))
            ctx = CallContext(mask=m, geometry=geom, backend=backend, scale=self.get_scale(q), positions=pos,
                              state=None if state is None else state.data,
                              state_position=0 if state is None else state.position,
                              return_state=stateful, needs_grad=needs_grad)
            result = self._run(q, k, v, ctx)
        _aux.bind_aux_records(self, result)
        if not stateful:
            return result
        out, data = result
        new = state.advanced(data, L, q)
        if caps.state_detached:
            new = new.detach()
        return (out, new) if return_state else out

    def _run(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Any:
        if _uses_attend(type(self)):
            return self._attend(q, k, v, ctx)
        # the version-1 spelling: _forward(causal, key_padding_mask, attn_mask) and _step
        if ctx.return_state:
            return self._step(q, k, v, ctx.state)
        causal = ctx.causal
        kpm = ctx.key_padding_mask
        rest = ctx.rest("causal", "key_padding")
        attn_mask = None
        if rest is not None:
            if rest.kinds == {"tensor"} and len(rest.leaves()) == 1:
                attn_mask = rest.t  # type: ignore[attr-defined]
            else:
                keep = rest.dense(ctx.geometry)
                bias = rest.bias(ctx.geometry, q.dtype)
                attn_mask = keep if bias is None else bias.masked_fill(~keep, float("-inf"))
            if attn_mask.is_floating_point() and attn_mask.dtype != q.dtype:
                attn_mask = attn_mask.to(q.dtype)
        return self._forward(q, k, v, causal=causal, key_padding_mask=kpm, attn_mask=attn_mask)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Any:
        """Compute attention for validated inputs (contract 2).

        Args:
            q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, E)``; keys
                and values at padded positions are already zero.
            ctx: the resolved :class:`~attnkit.context.CallContext`.

        Returns:
            ``(B, H, L, E)``, or ``(out, new_state_data)`` when ``ctx.return_state``.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _attend (or _forward)")

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _attend (or _forward)")

    # ---------------------------------------------------- context parallelism
    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, cp: Any) -> Tensor:
        """This rank's causal output rows of a sequence split across ranks (``Capabilities.context_parallel``).

        Called by :func:`attnkit.context_parallel.context_parallel` after it validated the chunk and
        zeroed padded keys and values. Args: ``q (B, H, L_r, D)``, ``k (B, H, L_r, D)``,
        ``v (B, H, L_r, E)`` and ``cp``, a :class:`attnkit.context_parallel.ContextParallel`
        (rank, offsets, key padding, collectives). Returns ``(B, H, L_r, E)``.
        """
        raise NotImplementedError(f"{type(self).__name__} declares context_parallel but has no _context_parallel")

    # ------------------------------------------------------------- streaming
    def init_state(self, batch: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> AttentionState:
        """A fresh streaming state for ``batch`` sequences.

        Raises:
            UnsupportedFeatureError: the implementation has no streaming form.
            InvalidInputError: ``batch`` not a positive int.
        """
        if self.caps.streaming is None:
            self._refuse("streaming (init_state/step)", "", streaming=True)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidInputError(f"init_state: batch must be a positive int, got {batch!r}")
        dev = torch.device(device) if device is not None else None
        data = self._init_state(batch, device=dev, dtype=dtype)
        return AttentionState(self.state_owner(), batch, dtype, dev, data)

    def step(self, q: Tensor, k: Tensor, v: Tensor, state: AttentionState) -> tuple[Tensor, AttentionState]:
        """Consume a chunk of T >= 1 new positions (the inference spelling of ``forward(state=...)``).

        Args:
            q: ``(B, H, T, D)``; k: ``(B, H, T, D)``; v: ``(B, H, T, E)``.
            state: from :meth:`init_state`, a previous :meth:`step` or
                ``forward(..., return_state=True)``.

        Returns:
            ``(out, new_state)`` with ``out`` of shape ``(B, H, T, E)``. For
            ``streaming="exact"``, concatenated outputs equal
            ``forward(..., causal=True)`` over the whole sequence.

        Raises:
            InvalidInputError: a state from another module, configuration,
                batch size, dtype or device (never cast or reset silently).
        """
        if self.caps.streaming is None:
            self._refuse("streaming (init_state/step)", "", streaming=True)
        cast = _amp.autocast_inputs(q, k, v, self.caps.dtypes)
        if cast is not None:   # as forward: inputs cast once, the step run with autocast off
            with torch.autocast(q.device.type, enabled=False):
                return self.step(*cast, state)
        self._check_qkv(q, k, v, "step")
        if q.shape[2] != k.shape[2] or q.shape[2] < 1:
            raise InvalidInputError(
                f"step: q, k and v must hold the same T >= 1 new positions, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if state is None:
            raise InvalidInputError("step: state is None; create one with init_state(batch)")
        if not isinstance(state, AttentionState):
            raise InvalidInputError(
                f"step: state must come from init_state(), step() or forward(return_state=True) of "
                f"{self.impl_name!r}, got {_describe(state)}")
        state.validate(self.state_owner(), q, "step")
        with _transforms.forward_ad_call(_transforms.dual_inputs(q, k, v, state.data)):
            self._transform_backend()
            out, data = self._step(q, k, v, state.data)
        _aux.bind_aux_records(self, out)
        new = state.advanced(data, q.shape[2], q)
        return out, (new.detach() if self.caps.state_detached else new)

    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} declares streaming but has no _init_state")

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__} declares streaming but has no _step")


def _uses_attend(cls: type) -> bool:
    """True when the most derived of ``_attend``/``_forward`` overrides is ``_attend`` (contract 2)."""
    for klass in cls.__mro__:
        if klass is Attention:
            return False
        if "_attend" in klass.__dict__:
            return True
        if "_forward" in klass.__dict__:
            return False
    return False


def _empty_output(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``(B, H, L, E)`` zeros for L = 0 or S = 0 (or an empty batch), connected to the graph of the empty inputs."""
    B, H, L, _ = q.shape
    out = q.new_zeros(B, H, L, v.shape[-1])
    empties = [t for t in (q, k, v) if t.numel() == 0 and t.requires_grad]
    for t in empties:
        out = out + t.sum() * 0
    return out


_TUNING: list[Any] = []  # [module or None], imported once


def _tuning() -> Any:
    if not _TUNING:
        try:
            from . import tuning
        except ImportError:
            tuning = None
        _TUNING.append(tuning)
    return _TUNING[0]


def _tuning_generation() -> int:
    tuning = _tuning()
    return getattr(tuning, "generation", lambda: 0)() if tuning is not None else 0


def _tuned_backend(attn: Attention, device: torch.device, dtype: torch.dtype, needs_grad: bool,
                   length: int) -> str | None:
    lookup = getattr(_tuning(), "tuned_backend", None)
    if lookup is None:
        return None
    try:
        return lookup(attn.spec, device=device, dtype=dtype, needs_grad=needs_grad, length=length)
    except Exception:  # noqa: BLE001 - a broken cache never breaks a forward
        return None
