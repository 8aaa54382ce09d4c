"""What the four kernelized attentions share: validation, masking, normalisation, dispatch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit import Attention
from attnkit.errors import InvalidInputError

from . import chunked


def check_int(name: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``value`` as an int >= ``minimum``; InvalidInputError naming ``name`` otherwise."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise InvalidInputError(f"{name}: expected {expected}, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise InvalidInputError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def normalize(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den != 0``; 0 where ``den == 0`` (a query that sees no key).

    Gradients stay finite: the masked branch never divides by 0.
    """
    empty = den == 0
    out = num / torch.where(empty, torch.ones_like(den), den).unsqueeze(-1)
    return out.masked_fill(empty.unsqueeze(-1), 0.0)


def key_mask(key_padding_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``(B, 1, S, 1)`` multiplier: 1 for real keys, 0 for padded ones (or None)."""
    if key_padding_mask is None:
        return None
    return key_padding_mask[:, None, :, None].to(dtype)


class KernelizedAttention(Attention):
    """Base of the kernelized attentions: ``phi(q) (phi(k)^T v) / phi(q) . sum phi(k)``.

    Subclasses provide :meth:`feature_pair`. This class validates the head
    dimension, zeroes ``phi(k)`` and ``v`` at padded keys (padded keys add
    nothing to the sums), computes the non-causal form with two matmuls and
    the causal form on the resolved backend (``torch`` chunked form, ``numba``
    CPU kernel, ``triton`` CUDA kernel), normalises with a guarded
    denominator, and streams through the state ``{"S": (B, H, M, E),
    "z": (B, H, M)}``.
    """

    refusal_reasons = {
        "attn_mask": ("a kernelized attention sums phi(k) v^T over keys before any query sees them, so it can "
                      "only drop whole keys (pass key_padding_mask, bool (B, S)) and the future (causal=True)"),
    }

    #: head_dim is required (features or parameters are drawn for it)
    _needs_head_dim = True

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", chunk_size: int = 64) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        if self._needs_head_dim and head_dim is None:
            raise InvalidInputError(
                f"{type(self).__name__}: head_dim: expected the head dimension D (an int >= 1) to draw "
                "features or parameters for, got None"
            )
        self.chunk_size = check_int("chunk_size", chunk_size)
        offered = type(self).capabilities.backends if type(self).capabilities else ("torch",)
        if backend != "auto" and backend not in offered:
            raise InvalidInputError(
                f"backend: {type(self).__name__} offers {list(offered)} (or 'auto'), got {backend!r}"
            )

    # ------------------------------------------------------------- hooks
    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q) (B, H, L, M), phi(k) (B, H, S, M))``; padded keys may hold anything (zeroed later)."""
        raise NotImplementedError

    @property
    def feature_dim(self) -> int:  # pragma: no cover - overridden
        """M, the number of features per head."""
        raise NotImplementedError

    def check_head_dim(self, q: Tensor, where: str = "forward") -> None:
        D = q.shape[-1]
        if self.head_dim is not None and D != self.head_dim:
            raise InvalidInputError(
                f"{where}: {self.impl_name!r} was built with head_dim={self.head_dim} (its features/"
                f"parameters were drawn for that size), expected q and k with last dimension "
                f"{self.head_dim}, got {D} (q {tuple(q.shape)}); build it with head_dim={D}"
            )

    # ----------------------------------------------------------- forward
    #: positions per segment of the no-grad causal numba path
    inference_segment = 2048

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        self.check_head_dim(q)
        if causal and not self._needs_grad(q, k, v) and self.resolve_backend(q, k, v) == "numba":
            return self._causal_numba_segments(q, k, v, key_padding_mask)
        phi_q, phi_k = self.feature_pair(q, k, causal=causal, key_padding_mask=key_padding_mask)
        keep = key_mask(key_padding_mask, phi_k.dtype)
        if keep is not None:
            phi_k = phi_k * keep
            v = v * keep
        backend = self.resolve_backend(phi_q, phi_k, v)   # also validates a forced backend
        if not causal:  # two matmuls on every backend
            return normalize(*chunked.noncausal_linear(phi_q, phi_k, v))
        if backend == "numba":
            from .kernels import causal_linear_attention_numba

            return causal_linear_attention_numba(phi_q, phi_k, v)
        return normalize(*self.causal_num_den(phi_q, phi_k, v, backend))

    def _needs_grad(self, *tensors: Tensor) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in list(tensors) + list(self.parameters()))

    def _causal_numba_segments(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """Causal forward without autograd: features and numba kernel one segment at a time, the prefix
        state carried between segments (exact; only one segment's features exist at a time, and they
        are consumed while still in cache)."""
        from .kernels.numba_autograd import causal_linear_attention_numba_inference

        B, H, L, _ = q.shape
        out = q.new_empty(B, H, L, v.shape[-1])
        state = None
        seg = self.inference_segment
        for s0 in range(0, L, seg):
            s1 = min(L, s0 + seg)
            kpm = None if key_padding_mask is None else key_padding_mask[:, s0:s1]
            qs, ks, vs = q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1]
            phi_q, phi_k = self.feature_pair(qs, ks, causal=True, key_padding_mask=kpm)
            keep = key_mask(kpm, phi_k.dtype)
            if keep is not None:
                phi_k, vs = phi_k * keep, vs * keep
            out[:, :, s0:s1], state = causal_linear_attention_numba_inference(phi_q, phi_k, vs, state)
        return out

    def causal_num_den(self, phi_q: Tensor, phi_k: Tensor, v: Tensor, backend: str | None = None
                       ) -> tuple[Tensor, Tensor]:
        """Causal numerator ``(B, H, L, E)`` and denominator ``(B, H, L)`` on ``backend`` (default: resolved)."""
        backend = backend or self.resolve_backend(phi_q, phi_k, v)
        if backend == "numba":
            from .kernels import causal_linear_numba

            return causal_linear_numba(phi_q, phi_k, v)
        if backend == "triton":
            from .kernels import causal_linear_triton

            return causal_linear_triton(phi_q, phi_k, v)
        num, den, _ = chunked.causal_linear(phi_q, phi_k, v, chunk=self.chunk_size)
        return num, den

    # --------------------------------------------------------- streaming
    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> Any:
        dtype = dtype or torch.get_default_dtype()
        H = self.num_heads or 1
        M = self.feature_dim
        E = self.head_dim or 1
        return {"S": torch.zeros(batch, H, M, E, device=device, dtype=dtype),
                "z": torch.zeros(batch, H, M, device=device, dtype=dtype), "t": 0}

    def _fit_state(self, state: Any, q: Tensor, v: Tensor, M: int) -> tuple[Tensor, Tensor]:
        """The state's tensors, reshaped to this step's (B, H, E) if it is still empty."""
        if not isinstance(state, dict) or "S" not in state or "z" not in state:
            raise InvalidInputError(
                f"step: state must be the dict returned by init_state()/step() of {self.impl_name!r}, "
                f"got {type(state).__name__}"
            )
        S, z = state["S"], state["z"]
        B, H, _, _ = q.shape
        E = v.shape[-1]
        want = (B, H, M, E)
        if tuple(S.shape) != want:
            if state.get("t", 0) == 0:  # a fresh state: adopt this step's H and E
                S = q.new_zeros(want)
                z = q.new_zeros(B, H, M)
            else:
                raise InvalidInputError(
                    f"step: the state holds S of shape {tuple(S.shape)} = (B, H, M, E), expected {want} "
                    f"for q {tuple(q.shape)} and v {tuple(v.shape)}"
                )
        return S.to(q.dtype), z.to(q.dtype)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        self.check_head_dim(q, "step")
        phi_q, phi_k = self.feature_pair(q, k, causal=True)
        S, z = self._fit_state(state, q, v, phi_q.shape[-1])
        num, den, (S, z) = chunked.causal_linear(phi_q, phi_k, v, chunk=self.chunk_size, state=(S, z))
        return normalize(num, den), {"S": S, "z": z, "t": state.get("t", 0) + q.shape[2]}
