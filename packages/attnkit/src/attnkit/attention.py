"""The contract: :class:`Attention`, the base class of every implementation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from . import backends as _backends
from .errors import InvalidInputError, UnsupportedFeatureError
from .spec import AttentionSpec, Capabilities

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"[:120]


class Attention(nn.Module):
    """Base class of every attnkit attention implementation.

    Subclasses implement :meth:`_forward` (and, with the ``streaming``
    capability, :meth:`_init_state` and :meth:`_step`). The public
    :meth:`forward` and :meth:`step` validate their inputs first and refuse,
    with :class:`~attnkit.errors.UnsupportedFeatureError`, anything the
    implementation's capabilities do not include, so nothing is ever ignored
    silently.

    Args:
        num_heads: number of heads H, for mechanisms with per-head parameters
            or state; None when not needed.
        head_dim: head dimension D, for mechanisms with parameters or random
            features drawn for D; None when not needed.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` picks the fastest available backend for the
            tensors' device; a backend name forces that one.
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
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
            raise InvalidInputError(f"scale: expected a positive float or None, got {scale!r}")
        if not isinstance(backend, str):
            raise InvalidInputError(f"backend: expected a backend name or 'auto', got {backend!r}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = None if scale is None else float(scale)
        self.backend = backend
        self._attnkit_spec: AttentionSpec | None = None

    # ------------------------------------------------------------------ spec
    @property
    def spec(self) -> AttentionSpec | None:
        """The registered spec (set by :func:`attnkit.build`, else looked up by class)."""
        if self._attnkit_spec is None:
            from .registry import default_registry

            self._attnkit_spec = default_registry().spec_for_class(type(self))
        return self._attnkit_spec

    @spec.setter
    def spec(self, value: AttentionSpec | None) -> None:
        self._attnkit_spec = value

    @property
    def caps(self) -> Capabilities:
        """The capabilities this instance honours."""
        spec = self.spec
        if spec is not None:
            return spec.capabilities
        return type(self).capabilities or Capabilities()

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

    def get_scale(self, q: Tensor) -> float:
        """``scale`` if given, else ``1/sqrt(D)`` for queries ``q`` of shape (..., D)."""
        return self.scale if self.scale is not None else q.shape[-1] ** -0.5

    def resolve_backend(self, *tensors: Tensor) -> str:
        """The backend to run for these tensors (see :mod:`attnkit.backends`)."""
        caps = self.caps
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in list(tensors) + list(self.parameters())
        )
        return _backends.select_backend(
            implementation=self.impl_name,
            offered=caps.backends,
            forward_only=caps.forward_only_backends,
            requested=self.backend,
            device=tensors[0].device,
            needs_grad=needs_grad,
        )

    # ------------------------------------------------------------ refusals
    def _refuse(self, argument: str, reason: str = "", *, given: str = "", **capability: Any) -> None:
        """Raise UnsupportedFeatureError; ``capability`` finds who supports it, ``refusal_reasons`` may reword."""
        from .registry import default_registry

        for key in capability:
            reason = type(self).refusal_reasons.get(key, reason)
        if given:
            reason = f"{reason}; {given}" if reason else given
        supported = [s.name for s in default_registry().available(**capability)] if capability else []
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
        dname = _DTYPE_NAMES.get(q.dtype, str(q.dtype))
        if dname not in self.caps.dtypes:
            self._refuse(f"dtype {dname}", f"it takes {', '.join(self.caps.dtypes)}", dtypes=dname)

    # --------------------------------------------------------------- forward
    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        """Attend queries to keys.

        Args:
            q: queries ``(B, H, L, D)``.
            k: keys ``(B, H, S, D)``.
            v: values ``(B, H, S, E)``.
            causal: query ``i`` sees only keys ``j <= i`` (bottom-right aligned
                when L != S, for implementations that allow it).
            key_padding_mask: bool ``(B, S)``, True = a real token.
            attn_mask: bool (True = attend) or additive float mask broadcastable
                to ``(B, H, L, S)``.

        Returns:
            ``(B, H, L, E)``, the dtype of ``q``. Fully masked query rows are 0.

        Raises:
            InvalidInputError: wrong types, ranks, shapes, dtypes or devices.
            UnsupportedFeatureError: an argument this implementation cannot honour.
        """
        self._check_qkv(q, k, v, "forward")
        B, H, L, _ = q.shape
        S = k.shape[2]
        caps = self.caps
        if not isinstance(causal, bool):
            raise InvalidInputError(f"causal: expected a bool, got {_describe(causal)}")
        if causal and not caps.causal:
            self._refuse("causal=True", "it has no causal form", causal=True)
        if not causal and not caps.noncausal:
            self._refuse("causal=False", "it is a causal-only recurrence; pass causal=True", noncausal=True)
        if L != S:
            if causal and not caps.causal_cross:
                self._refuse(f"causal=True with L != S (got L={L}, S={S})",
                             "its causal form needs queries and keys of one sequence", causal_cross=True)
            if not causal and not caps.cross:
                self._refuse(f"cross-attention (L={L} != S={S})", "", cross=True)
        if key_padding_mask is not None:
            if not caps.key_padding_mask:
                self._refuse("key_padding_mask", "", key_padding_mask=True)
            key_padding_mask = self._check_kpm(key_padding_mask, B, S, q.device, "forward")
        if attn_mask is not None:
            if not caps.attn_mask:
                self._refuse("attn_mask", "use key_padding_mask and causal, or an implementation with attn_mask",
                             given=f"expected attn_mask=None, got {_describe(attn_mask)}", attn_mask=True)
            attn_mask = self._check_attn_mask(attn_mask, B, H, L, S, q)
        return self._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)

    @staticmethod
    def _check_kpm(kpm: Any, B: int, S: int, device: torch.device, where: str) -> Tensor:
        if not isinstance(kpm, Tensor):
            raise InvalidInputError(f"{where}: key_padding_mask must be a bool tensor (B, S), got {_describe(kpm)}")
        if kpm.dtype != torch.bool:
            raise InvalidInputError(
                f"{where}: key_padding_mask must be bool (True = real token), got dtype {kpm.dtype}; "
                "convert with mask.bool() (note: attnkit's True means keep, unlike nn.MultiheadAttention)"
            )
        if tuple(kpm.shape) != (B, S):
            raise InvalidInputError(
                f"{where}: key_padding_mask must have shape (B, S) = ({B}, {S}), got {tuple(kpm.shape)}"
            )
        if kpm.device != device:
            raise InvalidInputError(
                f"{where}: key_padding_mask must be on {device} like q, got {kpm.device}"
            )
        return kpm

    @staticmethod
    def _check_attn_mask(m: Any, B: int, H: int, L: int, S: int, q: Tensor) -> Tensor:
        if not isinstance(m, Tensor):
            raise InvalidInputError(f"forward: attn_mask must be a tensor, got {_describe(m)}")
        if not (m.dtype == torch.bool or m.is_floating_point()):
            raise InvalidInputError(
                f"forward: attn_mask must be bool (True = attend) or an additive float mask, got dtype {m.dtype}"
            )
        full = (B, H, L, S)
        ok = m.dim() <= 4 and all(
            a in (1, b) for a, b in zip(reversed(tuple(m.shape)), reversed(full))
        )
        if not ok:
            raise InvalidInputError(
                f"forward: attn_mask must be broadcastable to (B, H, L, S) = {full}, got shape {tuple(m.shape)}"
            )
        if m.device != q.device:
            raise InvalidInputError(f"forward: attn_mask must be on {q.device} like q, got {m.device}")
        if m.is_floating_point() and m.dtype != q.dtype:
            m = m.to(q.dtype)
        return m

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _forward")

    # ------------------------------------------------------------- streaming
    def init_state(self, batch: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """A fresh streaming state for ``batch`` sequences.

        Raises:
            UnsupportedFeatureError: the implementation has no streaming form.
        """
        if self.caps.streaming is None:
            self._refuse("streaming (init_state/step)", "", streaming=True)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InvalidInputError(f"init_state: batch must be a positive int, got {batch!r}")
        return self._init_state(batch, device=torch.device(device) if device is not None else None,
                                dtype=dtype)

    def step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        """Consume a chunk of T >= 1 new positions.

        Args:
            q: ``(B, H, T, D)``; k: ``(B, H, T, D)``; v: ``(B, H, T, E)``.
            state: from :meth:`init_state` or a previous :meth:`step`.

        Returns:
            ``(out, new_state)`` with ``out`` of shape ``(B, H, T, E)``. For
            ``streaming="exact"``, concatenated outputs equal
            ``forward(..., causal=True)`` over the whole sequence.
        """
        if self.caps.streaming is None:
            self._refuse("streaming (init_state/step)", "", streaming=True)
        self._check_qkv(q, k, v, "step")
        if q.shape[2] != k.shape[2] or q.shape[2] < 1:
            raise InvalidInputError(
                f"step: q, k and v must hold the same T >= 1 new positions, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if state is None:
            raise InvalidInputError("step: state is None; create one with init_state(batch)")
        return self._step(q, k, v, state)

    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> Any:
        raise NotImplementedError(f"{type(self).__name__} declares streaming but has no _init_state")

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__} declares streaming but has no _step")
