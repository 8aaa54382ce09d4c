"""triton kernels (CUDA) of gated causal RFA and their operators: the chunked gated form, forward and backward.

The recurrence (the caller folds RFA's input gate ``1 - g_t`` into ``k``)::

    S_t = g_t S_{t-1} + k_t w_t^T,   out_t = S_t^T q_t

with ``w = [v, 1]`` (the denominator rides along as a column of ones, so
``S = [S, z]``). ``_gated_product_kernel`` is one program per (sequence,
block of columns of ``w``) that walks the sequence in chunks of ``BLOCK_L``
positions with the running state in registers, exactly the structure of the
chunked torch form (:mod:`.chunk`): with ``c`` the cumulative log decay from
the chunk's start (inclusive), inside a chunk the masked ``(C x C)`` product
``(q k^T) * exp(c_t - c_j)`` (exponents <= 0, masked before the exponential),
across chunks ``out += (q * exp(c)) S`` and ``S = exp(c_C) S + (k * exp(c_C - c))^T w``.
With ``REVERSE`` the same kernel runs the sequence backwards (``j >= t``,
decay ``exp(c_j - c_t)``, read ``exp(c_C - c_t)``, write ``exp(c_j)``): the
recurrence of the gradient of the state.

The backward pass is the chunked backward expressed with the same kernel
(three more products, no stored states), plus elementwise torch operations::

    G_t = dLoss/dS_t = sum_{s >= t} decay(t -> s) q_s g_s^T + decay(t -> end) G_final
    d q_t = S_t g_t                   product(g, w, k, state S_0^T)                 (forward)
    d k_t = G_t w_t                   product(w, g, q, state G_final^T, reversed)   (its end state is dS_0^T)
    d w_t = G_t^T k_t                 product(k, q, g, state G_final, reversed)
    d log g_t = sum_{s >= t} (q_s . dq_s - k_s . dk_s) + <G_final, S_final>

(``g = [d num, d den]``; the last line because ``log g_t`` enters every
decay through the cumulative sum: a query at ``s >= t`` gains it, a key at
``s >= t`` loses it, and the final state holds it).

Every product accumulates in float32 (float64 for float64 inputs), with IEEE
(not TF32) products: half-precision inputs keep float32 states, numerators and
denominators. This module imports triton at import time; it is imported only
when the ``triton`` backend runs. On CPU tensors it runs under
``TRITON_INTERPRET=1`` (set before the first import); timings need a CUDA device.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``triton_gated_product`` (the primitive, not differentiable) and
``triton_gated_attention`` (differentiable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._ops import define
from .._triton_fit import launch, wide_feature_tiles
from ..common import DEFAULT_CHUNK, normalize, with_ones_column


@triton.jit
def _gated_product_kernel(X, Y, W, LG, S0, OUT, SF, L, DX, DW,
                          stride_xn, stride_xl, stride_wn, stride_wl, stride_on, stride_ol,
                          BLOCK_L: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr,
                          REVERSE: tl.constexpr, F64: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)     # offsets in int64: B·H·L·M may pass 2^31
    pid_w = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    offs_x = tl.arange(0, BLOCK_X)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_l = tl.arange(0, BLOCK_L)
    mask_x = offs_x < DX
    mask_w = offs_w < DW
    s_ptrs = n * DX * DW + offs_x[:, None] * DW + offs_w[None, :]
    s_mask = mask_x[:, None] & mask_w[None, :]
    S = tl.load(S0 + s_ptrs, mask=s_mask, other=0.0).to(acc_t)
    if REVERSE:
        keep = offs_l[:, None] <= offs_l[None, :]
    else:
        keep = offs_l[:, None] >= offs_l[None, :]
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
        lg = tl.load(LG + n * L + t, mask=mask_t, other=0.0).to(acc_t)   # positions past L: no decay
        x = x.to(acc_t)
        y = y.to(acc_t)
        w = w.to(acc_t)
        cum = tl.cumsum(lg, axis=0)                       # log decay from the chunk's start to t, inclusive
        last = tl.sum(lg, axis=0)                         # across the whole chunk
        diff = cum[:, None] - cum[None, :]
        if REVERSE:
            diff = -diff
        decay = tl.where(keep, tl.exp(tl.where(keep, diff, 0.0)), 0.0)   # masked before exp: no overflow
        A = tl.where(keep, tl.dot(x, tl.trans(y), input_precision="ieee", out_dtype=acc_t) * decay, 0.0)
        if REVERSE:
            read = tl.exp(last - cum)
            write = tl.exp(cum)
        else:
            read = tl.exp(cum)
            write = tl.exp(last - cum)
        o = (tl.dot(A, w, input_precision="ieee", out_dtype=acc_t)
             + tl.dot(x * read[:, None], S, input_precision="ieee", out_dtype=acc_t))
        tl.store(OUT + n * stride_on + t[:, None] * stride_ol + offs_w[None, :], o.to(OUT.dtype.element_ty),
                 mask=mask_t[:, None] & mask_w[None, :])
        S = tl.exp(last) * S + tl.dot(tl.trans(y * write[:, None]), w, input_precision="ieee", out_dtype=acc_t)
    tl.store(SF + s_ptrs, S.to(SF.dtype.element_ty), mask=s_mask)


def _block(n: int, cap: int | None = None) -> int:
    b = max(16, triton.next_power_of_2(max(n, 1)))
    return min(b, cap) if cap else b


def _acc_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (the accumulation and output dtype)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _product(x: Tensor, y: Tensor, w: Tensor, log_g: Tensor, S0: Tensor, reverse: bool,
             chunk: int) -> tuple[Tensor, Tensor]:
    """The gated product primitive: ``x, y (N, L, DX)``, ``w (N, L, DW)``, ``log_g (N, L)``, ``S0 (N, DX, DW)``.

    Forward (``reverse=False``)::

        out_t = sum_{j <= t} exp(c_t - c_j) (x_t . y_j) w_j + exp(c_t) x_t^T S0,
        S     = exp(c_L) S0 + sum_j exp(c_L - c_j) y_j w_j^T

    with ``c_t = sum_{r <= t} log_g_r``; reversed, ``j >= t`` with ``exp(c_j - c_t)``,
    ``exp(c_L - c_t) x_t^T S0`` and ``S = exp(c_L) S0 + sum_j exp(c_j) y_j w_j^T``.
    Returns ``(out (N, L, DW), S (N, DX, DW))`` in float32 (float64 if an input is); ``chunk``
    rounds up to a power of two >= 16 (positions per block).
    """
    N, L, DX = x.shape
    DW = w.shape[2]
    if y.shape != x.shape or w.shape[:2] != (N, L) or log_g.shape != (N, L) or S0.shape != (N, DX, DW) \
            or chunk < 1:
        raise ValueError(f"triton_gated_product: expected x, y (N, L, DX), w (N, L, DW), log_g (N, L), "
                         f"S0 (N, DX, DW), chunk >= 1; got x {tuple(x.shape)}, y {tuple(y.shape)}, "
                         f"w {tuple(w.shape)}, log_g {tuple(log_g.shape)}, S0 {tuple(S0.shape)}, chunk={chunk}")
    acc = _acc_dtype(x, y, w, log_g, S0)
    x, y, w, log_g, S0 = (t.contiguous() for t in (x, y, w, log_g, S0))
    out = torch.empty(N, L, DW, dtype=acc, device=x.device)
    SF = torch.empty(N, DX, DW, dtype=acc, device=x.device)
    BLOCK_X, BLOCK_W = _block(DX), _block(DW, 64)
    meta = dict(BLOCK_L=_block(chunk), BLOCK_X=BLOCK_X, BLOCK_W=BLOCK_W, REVERSE=reverse, F64=acc == torch.float64,
                num_warps=8 if BLOCK_X >= 256 else 4)
    meta.update(wide_feature_tiles(BLOCK_X, meta["BLOCK_L"]))
    if N:  # positions per block and value columns per program may shrink to fit shared memory
        launch(_gated_product_kernel, lambda m: (N, triton.cdiv(max(DW, 1), m["BLOCK_W"])), (
            x, y, w, log_g, S0, out, SF, L, DX, DW, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            out.stride(0), out.stride(1)), meta, shrink=("BLOCK_L", "BLOCK_W"))
    return out, SF


def _product_fake(x, y, w, log_g, S0, reverse, chunk):
    acc = _acc_dtype(x, y, w, log_g, S0)
    N, L, DX = x.shape
    return x.new_empty(N, L, w.shape[2], dtype=acc), x.new_empty(N, DX, w.shape[2], dtype=acc)


#: ``attnkit_kernelized::triton_gated_product``: ``(x, y, w, log_g, S0, reverse, chunk) -> (out, S)``
triton_gated_product = define("triton_gated_product", _product, _product_fake)


# ------------------------------------------------------------------ the differentiable operator
def _seq(x: Tensor) -> Tensor:
    """``(B, H, ...)`` -> contiguous ``(B*H, ...)``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, S0: Tensor, z0: Tensor,
             chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    Sp0 = torch.cat([S0, z0.unsqueeze(-1)], dim=-1)
    out, SF = triton_gated_product(_seq(phi_q), _seq(phi_k), _seq(with_ones_column(v)), _seq(log_g),
                                   _seq(Sp0.to(_acc_dtype(phi_q, S0))), False, chunk)
    out, SF = out.view(B, H, L, E + 1), SF.view(B, H, M, E + 1)
    return _own(out[..., :E]), _own(out[..., E]), _own(SF[..., :E]), _own(SF[..., E])


def _own(x: Tensor) -> Tensor:
    """A contiguous tensor of its own (an operator's outputs may not be views of each other; ``contiguous`` returns
    an empty or already contiguous slice as the view it is)."""
    x = x.contiguous()
    return x.clone() if x._base is not None else x


def _forward_fake(phi_q, phi_k, v, log_g, S0, z0, chunk):
    B, H, L, M = phi_q.shape
    acc = _acc_dtype(phi_q, S0)
    E = v.shape[-1]
    return (v.new_empty(B, H, L, E, dtype=acc), v.new_empty(B, H, L, dtype=acc), S0.new_empty(B, H, M, E, dtype=acc),
            z0.new_empty(B, H, M, dtype=acc))


def _setup_context(ctx, inputs, output):
    phi_q, phi_k, v, log_g, S0, z0, chunk = inputs
    _, _, S, z = output
    ctx.save_for_backward(phi_q, phi_k, v, log_g, S0, z0, S, z)
    ctx.chunk = chunk
    ctx.set_materialize_grads(False)


def _backward(ctx, g_num, g_den, g_S, g_z):
    phi_q, phi_k, v, log_g, S0, z0, S, z = (t.contiguous() for t in ctx.saved_tensors)
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    acc = S.dtype
    g_num = phi_q.new_zeros(B, H, L, E, dtype=acc) if g_num is None else g_num.to(acc)
    g_den = phi_q.new_zeros(B, H, L, dtype=acc) if g_den is None else g_den.to(acc)
    G = torch.cat([phi_q.new_zeros(B, H, M, E, dtype=acc) if g_S is None else g_S.to(acc),
                   (phi_q.new_zeros(B, H, M, dtype=acc) if g_z is None else g_z.to(acc)).unsqueeze(-1)], dim=-1)
    gp = _seq(torch.cat([g_num, g_den.unsqueeze(-1)], dim=-1))          # (N, L, E+1)
    wp = _seq(with_ones_column(v))
    lg = _seq(log_g)
    Sp0 = torch.cat([S0, z0.unsqueeze(-1)], dim=-1).to(acc)
    chunk = ctx.chunk
    dq = triton_gated_product(gp, wp, _seq(phi_k), lg, _seq(Sp0.transpose(-1, -2)), False, chunk)[0]
    dk, dSp0T = triton_gated_product(wp, gp, _seq(phi_q), lg, _seq(G.transpose(-1, -2)), True, chunk)
    dw = triton_gated_product(_seq(phi_k), _seq(phi_q), gp, lg, _seq(G), True, chunk)[0]
    dq, dk, dw = dq.view(B, H, L, M), dk.view(B, H, L, M), dw.view(B, H, L, E + 1)
    dSp0 = dSp0T.view(B, H, E + 1, M).transpose(-1, -2)
    # log g_t enters every cumulative decay from t on: d log g_t = sum_{s >= t} (q_s . dq_s - k_s . dk_s), plus
    # the final state's <G, S_L> (it holds every decay)
    Sp = torch.cat([S, z.unsqueeze(-1)], dim=-1)
    per = (phi_q.to(acc) * dq).sum(-1) - (phi_k.to(acc) * dk).sum(-1)
    dlg = per.flip(-1).cumsum(-1).flip(-1) + (G * Sp).sum((-1, -2)).unsqueeze(-1)
    return (dq.to(phi_q.dtype), dk.to(phi_k.dtype), dw[..., :E].to(v.dtype), dlg.to(log_g.dtype),
            dSp0[..., :E].to(S0.dtype), dSp0[..., E].to(z0.dtype), None)


#: ``attnkit_kernelized::triton_gated_attention``: ``(phi_q, phi_k, v, log_g, S0, z0, chunk) -> (num, den, S, z)``
#: (float32 for half-precision inputs), differentiable in the first six inputs
triton_gated_attention = define("triton_gated_attention", _forward, _forward_fake, backward=_backward,
                                setup_context=_setup_context)


def gated_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, S0: Tensor | None = None,
                    z0: Tensor | None = None, *, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Gated causal linear attention with the triton kernels (the ``triton`` backend of causal ``rfa``).

    Args:
        phi_q, phi_k: ``(B, H, L, M)`` (the input gate folded into ``phi_k``); v: ``(B, H, L, E)``; CUDA
            tensors (or CPU tensors under ``TRITON_INTERPRET=1``), float16/bfloat16/float32/float64.
        log_g: ``(B, H, L)`` log of the decays ``g_t`` in (0, 1] (0: no decay).
        S0, z0: the state ``(B, H, M, E)``, ``(B, H, M)`` carried in (None: zeros).
        chunk: positions per block (rounded up to a power of two >= 16).

    Returns:
        ``(out (B, H, L, E), S, z)``: ``num / den`` (0 where ``den == 0``) in the dtype of ``v``, and the final
        state, accumulated and returned in float32 for half-precision inputs (float64 for float64).
    """
    B, H, L, M = phi_q.shape
    acc = _acc_dtype(phi_q, v)
    S0 = phi_q.new_zeros(B, H, M, v.shape[-1], dtype=acc) if S0 is None else S0.to(acc)
    z0 = phi_q.new_zeros(B, H, M, dtype=acc) if z0 is None else z0.to(acc)
    num, den, S, z = triton_gated_attention(phi_q, phi_k, v, log_g, S0, z0, chunk)
    return normalize(num, den).to(v.dtype), S, z
