"""triton kernels (CUDA) for the causal product of linear attention, forward and backward.

Same primitive as :mod:`.causal_numba`::

    out[t] = sum_{j <= t} (x[t] . y[j]) w[j]     (j >= t when REVERSE)
    den[t] = sum_{j <= t} (x[t] . y[j])          (WITH_DEN)

One program per (sequence, block of E columns of ``w``) walks the sequence in
chunks of ``BLOCK_L`` positions, holding the running state
``S = sum_j y_j w_j^T`` (``BLOCK_M x BLOCK_E``) in registers: per chunk one
masked ``x y^T`` block (``tl.dot``), ``A w + x S``, then ``S += y^T w``.
Accumulation is float32 (float64 for float64 inputs), with IEEE (not TF32)
products so results agree with the torch path in float32. The backward pass is
three more causal products (see :mod:`.causal_numba`).

This module imports triton at import time; it is imported only when the
``triton`` backend runs. On CPU tensors it runs under ``TRITON_INTERPRET=1``
(the tests); timings need a CUDA device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..chunked import with_ones_column

DEFAULT_BLOCK_L = 64


@triton.jit
def _causal_product_kernel(X, Y, W, OUT, DEN, L, DX, DW,
                           stride_xn, stride_xl, stride_wn, stride_wl, stride_on, stride_ol, stride_dn,
                           BLOCK_L: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr,
                           REVERSE: tl.constexpr, WITH_DEN: tl.constexpr, F64: tl.constexpr):
    n = tl.program_id(0)
    pid_w = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    offs_x = tl.arange(0, BLOCK_X)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_l = tl.arange(0, BLOCK_L)
    mask_x = offs_x < DX
    mask_w = offs_w < DW
    S = tl.zeros([BLOCK_X, BLOCK_W], dtype=acc_t)
    z = tl.zeros([BLOCK_X], dtype=acc_t)
    n_chunks = tl.cdiv(L, BLOCK_L)
    for i in range(0, n_chunks):
        if REVERSE:
            c = n_chunks - 1 - i
        else:
            c = i
        t = c * BLOCK_L + offs_l
        mask_t = t < L
        xy_mask = mask_t[:, None] & mask_x[None, :]
        x = tl.load(X + n * stride_xn + t[:, None] * stride_xl + offs_x[None, :], mask=xy_mask, other=0.0)
        y = tl.load(Y + n * stride_xn + t[:, None] * stride_xl + offs_x[None, :], mask=xy_mask, other=0.0)
        w = tl.load(W + n * stride_wn + t[:, None] * stride_wl + offs_w[None, :],
                    mask=mask_t[:, None] & mask_w[None, :], other=0.0)
        x = x.to(acc_t)
        y = y.to(acc_t)
        w = w.to(acc_t)
        A = tl.dot(x, tl.trans(y), input_precision="ieee", out_dtype=acc_t)
        if REVERSE:
            keep = offs_l[:, None] <= offs_l[None, :]
        else:
            keep = offs_l[:, None] >= offs_l[None, :]
        A = tl.where(keep, A, 0.0)
        o = (tl.dot(A, w, input_precision="ieee", out_dtype=acc_t)
             + tl.dot(x, S, input_precision="ieee", out_dtype=acc_t))
        tl.store(OUT + n * stride_on + t[:, None] * stride_ol + offs_w[None, :], o.to(OUT.dtype.element_ty),
                 mask=mask_t[:, None] & mask_w[None, :])
        if WITH_DEN:
            if pid_w == 0:
                den = tl.sum(A, axis=1) + tl.sum(x * z[None, :], axis=1)
                tl.store(DEN + n * stride_dn + t, den.to(DEN.dtype.element_ty), mask=mask_t)
            z += tl.sum(y, axis=0)
        S += tl.dot(tl.trans(y), w, input_precision="ieee", out_dtype=acc_t)


def _block(n: int, cap: int | None = None) -> int:
    b = max(16, triton.next_power_of_2(n))
    return min(b, cap) if cap else b


def causal_product(x: Tensor, y: Tensor, w: Tensor, *, reverse: bool = False, with_den: bool = False,
                   block_l: int = DEFAULT_BLOCK_L):
    """The causal product on ``(N, L, DX)``, ``(N, L, DX)``, ``(N, L, DW)`` tensors.

    Returns:
        ``out (N, L, DW)``, or ``(out, den (N, L))`` when ``with_den``.
    """
    x, y, w = x.contiguous(), y.contiguous(), w.contiguous()
    N, L, DX = x.shape
    DW = w.shape[-1]
    out = torch.empty(N, L, DW, dtype=x.dtype, device=x.device)
    den = torch.empty(N, L if with_den else 1, dtype=x.dtype, device=x.device)
    BLOCK_W = _block(DW, 64)
    grid = (N, triton.cdiv(DW, BLOCK_W))
    _causal_product_kernel[grid](
        x, y, w, out, den, L, DX, DW,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), den.stride(0),
        BLOCK_L=block_l, BLOCK_X=_block(DX), BLOCK_W=BLOCK_W, REVERSE=reverse, WITH_DEN=with_den,
        F64=x.dtype == torch.float64, num_warps=8 if _block(DX) >= 256 else 4,
    )
    return (out, den) if with_den else out


class _CausalLinearTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, phi_q: Tensor, phi_k: Tensor, v: Tensor, block_l: int):
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        num, den = causal_product(phi_q.reshape(N, L, M), phi_k.reshape(N, L, M), v.reshape(N, L, E),
                                  with_den=True, block_l=block_l)
        ctx.save_for_backward(phi_q, phi_k, v)
        ctx.set_materialize_grads(False)  # an unused denominator arrives as None
        ctx.block_l = block_l
        return num.view(B, H, L, E), den.view(B, H, L)

    @staticmethod
    def backward(ctx, g_num: Tensor | None, g_den: Tensor | None):
        phi_q, phi_k, v = ctx.saved_tensors
        B, H, L, M = phi_q.shape
        E = v.shape[-1]
        N = B * H
        if g_num is None:
            g_num = torch.zeros_like(v)
        g, vv = g_num, v
        if g_den is not None:
            g = torch.cat([g_num, g_den.unsqueeze(-1)], dim=-1)
            vv = with_ones_column(v)
        q_, k_ = phi_q.reshape(N, L, M), phi_k.reshape(N, L, M)
        g_, vv_ = g.reshape(N, L, -1), vv.reshape(N, L, -1)
        bl = ctx.block_l
        dq = causal_product(g_, vv_, k_, block_l=bl)
        dk = causal_product(vv_, g_, q_, reverse=True, block_l=bl)
        dv = causal_product(k_, q_, g_num.reshape(N, L, E), reverse=True, block_l=bl)
        return dq.view(B, H, L, M), dk.view(B, H, L, M), dv.view(B, H, L, E), None


def causal_linear_triton(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, chunk: int | None = None
                         ) -> tuple[Tensor, Tensor]:
    """Numerator ``(B, H, L, E)`` and denominator ``(B, H, L)`` of causal linear attention (triton).

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``; CUDA tensors (or CPU
            tensors under ``TRITON_INTERPRET=1``).
        chunk: positions per block (a power of two >= 16; default 64).
    """
    block_l = DEFAULT_BLOCK_L if chunk is None else max(16, triton.next_power_of_2(int(chunk)))
    return _CausalLinearTriton.apply(phi_q, phi_k, v, block_l)
