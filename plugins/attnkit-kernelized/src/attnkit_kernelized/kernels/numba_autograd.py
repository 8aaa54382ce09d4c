"""``torch.autograd.Function`` wrappers of the numba CPU kernels.

Tensors cross into numba as zero-copy NumPy views of contiguous CPU tensors
``(B*H, L, ·)``; results come back with :func:`torch.from_numpy` (no copy).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..chunked import with_ones_column
from . import causal_numba as K

_DELTA_CHUNK = 64


def _np(x: Tensor, N: int):
    """A (N, L, ·) contiguous NumPy view of a CPU tensor (B, H, L, ·)."""
    return x.detach().reshape(N, *x.shape[2:]).contiguous().numpy()


class _CausalLinear(torch.autograd.Function):
    """num_t = sum_{j<=t} (phi_q_t . phi_k_j) v_j, den_t = sum_{j<=t} phi_q_t . phi_k_j."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, v: Tensor, chunk: int):
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        out, den = K.causal_product(_np(phi_q, N), _np(phi_k, N), _np(v, N), chunk=chunk, with_den=True)
        ctx.save_for_backward(phi_q, phi_k, v)
        ctx.set_materialize_grads(False)  # an unused denominator arrives as None
        ctx.chunk = chunk
        return (torch.from_numpy(out).view(B, H, L, E), torch.from_numpy(den).view(B, H, L))

    @staticmethod
    @once_differentiable
    def backward(ctx, g_num: Tensor | None, g_den: Tensor | None):
        phi_q, phi_k, v = ctx.saved_tensors
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        chunk = ctx.chunk
        if g_num is None:
            g_num = torch.zeros_like(v)
        g = g_num
        vv = v
        if g_den is not None:
            # the denominator is the product with a column of ones appended to v
            g = torch.cat([g_num, g_den.unsqueeze(-1)], dim=-1)
            vv = with_ones_column(v)
        q_, k_, g_, vv_ = _np(phi_q, N), _np(phi_k, N), _np(g, N), _np(vv, N)
        dq = K.causal_product(g_, vv_, k_, chunk=chunk)
        dk = K.causal_product(vv_, g_, q_, reverse=True, chunk=chunk)
        dv = K.causal_product(k_, q_, _np(g_num, N), reverse=True, chunk=chunk)
        return (torch.from_numpy(dq).view(B, H, L, M), torch.from_numpy(dk).view(B, H, L, M),
                torch.from_numpy(dv).view(B, H, L, E), None)


def causal_linear_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, chunk: int | None = None
                        ) -> tuple[Tensor, Tensor]:
    """Numerator ``(B, H, L, E)`` and denominator ``(B, H, L)`` of causal linear attention (numba).

    Args:
        phi_q, phi_k: ``(B, H, L, M)`` float32/float64 CPU tensors.
        v: ``(B, H, L, E)``.
        chunk: positions per kernel block (default :data:`causal_numba.DEFAULT_CHUNK`).
    """
    return _CausalLinear.apply(phi_q, phi_k, v, int(chunk or K.DEFAULT_CHUNK))


class _CausalLinearNormalized(torch.autograd.Function):
    """out_t = num_t / den_t (0 where den_t == 0), with the division fused into the kernel call."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, v: Tensor, chunk: int):
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        out, den = K.causal_product(_np(phi_q, N), _np(phi_k, N), _np(v, N), chunk=chunk, with_den=True,
                                    normalize=True)
        out_t = torch.from_numpy(out).view(B, H, L, E)
        den_t = torch.from_numpy(den).view(B, H, L)
        ctx.save_for_backward(phi_q, phi_k, v, out_t, den_t)
        ctx.chunk = chunk
        return out_t

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):
        phi_q, phi_k, v, out, den = ctx.saved_tensors
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        chunk = ctx.chunk
        # out = num / den: d num = g / den, d den = -(g . out) / den; both 0 where den == 0
        empty = den == 0
        inv = torch.where(empty, torch.zeros_like(den), 1 / torch.where(empty, torch.ones_like(den), den))
        g_num = g * inv.unsqueeze(-1)
        g_den = -(g * out).sum(-1) * inv
        g1 = torch.cat([g_num, g_den.unsqueeze(-1)], dim=-1)
        v1 = with_ones_column(v)
        q_, k_, g_, v_ = _np(phi_q, N), _np(phi_k, N), _np(g1, N), _np(v1, N)
        dq = K.causal_product(g_, v_, k_, chunk=chunk)
        dk = K.causal_product(v_, g_, q_, reverse=True, chunk=chunk)
        dv = K.causal_product(k_, q_, _np(g_num, N), reverse=True, chunk=chunk)
        return (torch.from_numpy(dq).view(B, H, L, M), torch.from_numpy(dk).view(B, H, L, M),
                torch.from_numpy(dv).view(B, H, L, E), None)


@torch.no_grad()
def causal_linear_attention_numba_inference(phi_q: Tensor, phi_k: Tensor, v: Tensor,
                                            state: tuple[Tensor, Tensor] | None, *, chunk: int | None = None
                                            ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """No-grad causal linear attention that starts from and returns the state ``(S^T (B, H, E, M), z (B, H, M))``.

    The forward pass of an attention module runs this segment by segment when
    no gradient is needed, so the features of only one segment exist at a time.
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    N = B * H
    st = None if state is None else (state[0].reshape(N, E, M).numpy(), state[1].reshape(N, M).numpy())
    out, _, (ST, z) = K.causal_product(_np(phi_q, N), _np(phi_k, N), _np(v, N), chunk=int(chunk or K.DEFAULT_CHUNK),
                                       with_den=True, normalize=True, state=st, return_state=True)
    return (torch.from_numpy(out).view(B, H, L, E),
            (torch.from_numpy(ST).view(B, H, E, M), torch.from_numpy(z).view(B, H, M)))


def causal_linear_attention_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, chunk: int | None = None
                                  ) -> Tensor:
    """Causal linear attention ``num / den`` ``(B, H, L, E)`` (numba; rows with no visible key are 0).

    Args:
        phi_q, phi_k: ``(B, H, L, M)`` float32/float64 CPU tensors.
        v: ``(B, H, L, E)``.
        chunk: positions per kernel block (default :data:`causal_numba.DEFAULT_CHUNK`).
    """
    return _CausalLinearNormalized.apply(phi_q, phi_k, v, int(chunk or K.DEFAULT_CHUNK))


class _CausalDelta(torch.autograd.Function):
    """Delta-rule fast weights, out_t = S_t^T phi_q_t."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, chunk: int):
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        b = beta.detach().reshape(N, L).contiguous().numpy()
        out, ckpt = K.delta_forward(_np(phi_q, N), _np(phi_k, N), _np(v, N), b, chunk)
        ctx.save_for_backward(phi_q, phi_k, v, beta)
        ctx.ckpt = ckpt
        ctx.chunk = chunk
        return torch.from_numpy(out).view(B, H, L, E)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor):
        phi_q, phi_k, v, beta = ctx.saved_tensors
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        b = beta.detach().reshape(N, L).contiguous().numpy()
        dq, dk, dv, db = K.delta_backward(_np(phi_q, N), _np(phi_k, N), _np(v, N), b, ctx.ckpt,
                                           _np(g, N), ctx.chunk)
        return (torch.from_numpy(dq).view(B, H, L, M), torch.from_numpy(dk).view(B, H, L, M),
                torch.from_numpy(dv).view(B, H, L, E), torch.from_numpy(db).view(B, H, L), None)


def causal_delta_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, *, chunk: int | None = None
                       ) -> Tensor:
    """Delta-rule fast-weight output ``(B, H, L, E)`` (numba; per-position recurrence, checkpointed
    every ``chunk`` positions for the backward pass).

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``; beta: ``(B, H, L)``.
    """
    return _CausalDelta.apply(phi_q, phi_k, v, beta, int(chunk or _DELTA_CHUNK))


class _CausalGated(torch.autograd.Function):
    """Gated causal linear attention (RFA): numerator and denominator."""

    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, chunk: int):
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        gn = g.detach().reshape(N, L).contiguous().numpy()
        num, den, ckS, ckz = K.gated_forward(_np(phi_q, N), _np(phi_k, N), _np(v, N), gn, chunk)
        ctx.save_for_backward(phi_q, phi_k, v, g)
        ctx.ckpt = (ckS, ckz)
        ctx.chunk = chunk
        return torch.from_numpy(num).view(B, H, L, E), torch.from_numpy(den).view(B, H, L)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_num: Tensor, g_den: Tensor):
        phi_q, phi_k, v, g = ctx.saved_tensors
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        gn = g.detach().reshape(N, L).contiguous().numpy()
        dq, dk, dv, dg = K.gated_backward(_np(phi_q, N), _np(phi_k, N), _np(v, N), gn, *ctx.ckpt,
                                          _np(g_num, N), g_den.reshape(N, L).contiguous().numpy(), ctx.chunk)
        return (torch.from_numpy(dq).view(B, H, L, M), torch.from_numpy(dk).view(B, H, L, M),
                torch.from_numpy(dv).view(B, H, L, E), torch.from_numpy(dg).view(B, H, L), None)


def causal_gated_numba(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, *, chunk: int | None = None
                       ) -> tuple[Tensor, Tensor]:
    """Gated causal numerator ``(B, H, L, E)`` and denominator ``(B, H, L)`` (numba; per-position
    recurrence ``S_t = g_t S_{t-1} + phi_k_t v_t^T``, checkpointed every ``chunk`` positions for
    the backward pass).

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``; g: ``(B, H, L)`` decays in [0, 1].
    """
    return _CausalGated.apply(phi_q, phi_k, v, g, int(chunk or _DELTA_CHUNK))
