"""Fast paths of the causal kernelized forms.

* :mod:`.causal_numba`: CPU kernels (numba), imported on first use.
* :mod:`.causal_triton`: CUDA kernels (triton), imported on first use; triton
  is optional and never needed to import the plugin.

:func:`causal_linear_numba` and :func:`causal_linear_triton` are the
autograd-aware entry points the attention modules call; both return the
numerator ``(B, H, L, E)`` and denominator ``(B, H, L)`` of causal linear
attention for features ``phi_q, phi_k (B, H, L, M)`` and values ``v``.
"""

from __future__ import annotations

from torch import Tensor


def causal_linear_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, chunk: int | None = None
                        ) -> tuple[Tensor, Tensor]:
    """Causal numerator and denominator with the numba CPU kernel (differentiable)."""
    from .numba_autograd import causal_linear_numba as fn

    return fn(phi_q, phi_k, v, chunk=chunk)


def causal_linear_attention_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, chunk: int | None = None
                                  ) -> Tensor:
    """Causal linear attention ``num / den`` with the numba CPU kernel (differentiable, fused division)."""
    from .numba_autograd import causal_linear_attention_numba as fn

    return fn(phi_q, phi_k, v, chunk=chunk)


def causal_linear_triton(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, chunk: int | None = None
                         ) -> tuple[Tensor, Tensor]:
    """Causal numerator and denominator with the triton kernel (differentiable)."""
    from .causal_triton import causal_linear_triton as fn

    return fn(phi_q, phi_k, v, chunk=chunk)


def causal_delta_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, *, chunk: int | None = None
                       ) -> Tensor:
    """Delta-rule fast-weight output with the numba CPU kernel (differentiable)."""
    from .numba_autograd import causal_delta_numba as fn

    return fn(phi_q, phi_k, v, beta, chunk=chunk)


def causal_gated_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, *, chunk: int | None = None
                       ) -> tuple[Tensor, Tensor]:
    """Gated (RFA) causal numerator and denominator with the numba CPU kernel (differentiable)."""
    from .numba_autograd import causal_gated_numba as fn

    return fn(phi_q, phi_k, v, g, chunk=chunk)
