"""triton kernels (CUDA) of gated causal RFA and their operators: the chunked gated form, forward and backward.

The recurrence (the caller folds RFA's input gate ``1 - g_t`` into ``k``)::

    S_t = g_t S_{t-1} + k_t w_t^T,   out_t = S_t^T q_t

with ``w = [v, 1]`` (the denominator rides along as a column of ones, so
``S = [S, z]``). With ``c`` the cumulative log decay from a chunk's start
(inclusive) and ``C`` chunks of ``BLOCK_L`` positions, three kernels, every
chunk in parallel but the scan (the structure of the linear kernels,
:mod:`attnkit_kernelized.linear.triton_ops`, with decays):

1. ``_gated_state_kernel``, one program per (sequence and chunk, block of
   features, block of columns of ``w``): the chunk's own contribution to the
   state at its end, ``(k * exp(c_C - c))^T w``.
2. ``_gated_scan_kernel``, one program per (sequence, block of the state):
   ``S = exp(c_C) S + contribution`` over the chunks, elementwise, writing the
   state entering each chunk over its contribution.
3. ``_gated_out_kernel``, one program per (sequence and chunk, block of
   columns of ``w``): the masked ``(C x C)`` product ``(q k^T) * exp(c_t - c_j)``
   (exponents <= 0, masked before the exponential) times ``w``, plus
   ``(q * exp(c)) S`` with the entering state, the features in blocks of 64.

With ``REVERSE`` the same kernels run the sequence backwards (``j >= t``,
decay ``exp(c_j - c_t)``, read ``exp(c_C - c_t)``, write ``exp(c_j)``): the
recurrence of the gradient of the state. (Until session 34 one program per
sequence walked the chunks in order with the state in registers: 8 programs
for B·H = 8, 1.9-3.3x slower than the torch form's forward+backward on an
H100, docs/benchmarks.md, "GPU run 5".)

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

Every product accumulates in float32 (float64 for float64 inputs) with its
operands widened to that dtype: IEEE products for float32 and float64 inputs;
for half-precision inputs tensor-core products, TF32 (bfloat16) or 3xTF32
(float16; :func:`_precision`). Half-precision inputs keep float32 states,
numerators and denominators. The states entering each chunk take
``B·H·(L/C)·M·(E+1)`` floats of scratch (545 MB at B·H = 8, L = 65,536,
M = 256, E = 64). This module imports triton at import time; it is imported only
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

from .._ops import acc_dtype as _acc_dtype
from .._ops import define
from .._triton_fit import block as _block
from .._triton_fit import launch
from ..common import DEFAULT_CHUNK, normalize, with_ones_column


@triton.jit
def _gated_state_kernel(Y, W, LG, H, L, DX, DW, n_chunks, stride_yn, stride_yl, stride_wn, stride_wl,
                        stride_hn, stride_hc, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                        REVERSE: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """One chunk's own contribution to the state at its far end: ``(y * write)^T w``, one program per (sequence and
    chunk, block of features, block of value columns), every chunk in parallel."""
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)     # offsets in int64: B·H·L·M may pass 2^31
    c = pid % n_chunks
    acc_t = tl.float64 if F64 else tl.float32
    t = c * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_t = t < L
    mask_k = offs_k < DX
    mask_w = offs_w < DW
    lg = tl.load(LG + n * L + t, mask=mask_t, other=0.0).to(acc_t)   # positions past L: no decay
    cum = tl.cumsum(lg, axis=0)                                       # log decay from the chunk's start, inclusive
    if REVERSE:
        write = tl.exp(cum)
    else:
        write = tl.exp(tl.sum(lg, axis=0) - cum)
    y = tl.load(Y + n * stride_yn + t[:, None] * stride_yl + offs_k[None, :],
                mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(acc_t)
    w = tl.load(W + n * stride_wn + t[:, None] * stride_wl + offs_w[None, :],
                mask=mask_t[:, None] & mask_w[None, :], other=0.0).to(acc_t)
    u = tl.dot(tl.trans(y * write[:, None]), w, input_precision=PREC, out_dtype=acc_t)
    tl.store(H + n * stride_hn + c * stride_hc + offs_k[:, None] * DW + offs_w[None, :], u,
             mask=mask_k[:, None] & mask_w[None, :])


@triton.jit
def _gated_scan_kernel(LG, S0, H, SF, L, DX, DW, n_chunks, stride_hn, stride_hc,
                       BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                       REVERSE: tl.constexpr, F64: tl.constexpr):
    """The scan over chunks, one program per (sequence, block of the state): ``H[c]`` holds chunk ``c``'s own
    contribution on entry and the state entering chunk ``c`` on exit; ``S = exp(last_c) S + H[c]`` (elementwise,
    no products)."""
    n = tl.program_id(0).to(tl.int64)
    acc_t = tl.float64 if F64 else tl.float32
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_w = tl.program_id(2) * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_l = tl.arange(0, BLOCK_L)
    s_off = offs_k[:, None] * DW + offs_w[None, :]
    s_mask = (offs_k < DX)[:, None] & (offs_w < DW)[None, :]
    S = tl.load(S0 + n * DX * DW + s_off, mask=s_mask, other=0.0).to(acc_t)
    for i in range(0, n_chunks):
        if REVERSE:
            c = n_chunks - 1 - i
        else:
            c = i
        t = c * BLOCK_L + offs_l
        last = tl.sum(tl.load(LG + n * L + t, mask=t < L, other=0.0).to(acc_t), axis=0)
        h_ptrs = H + n * stride_hn + c * stride_hc + s_off
        u = tl.load(h_ptrs, mask=s_mask, other=0.0)
        tl.store(h_ptrs, S, mask=s_mask)
        S = tl.exp(last) * S + u
    tl.store(SF + n * DX * DW + s_off, S.to(SF.dtype.element_ty), mask=s_mask)


@triton.jit
def _gated_out_kernel(X, Y, W, LG, H, OUT, L, DX, DW, n_chunks, stride_xn, stride_xl, stride_wn, stride_wl,
                      stride_on, stride_ol, stride_hn, stride_hc,
                      BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                      REVERSE: tl.constexpr, F64: tl.constexpr, PREC: tl.constexpr):
    """One chunk's outputs, one program per (sequence and chunk, block of value columns), every chunk in parallel:
    ``mask(x y^T * decay) w + (x * read) S_c`` with ``S_c`` the state entering the chunk (from the scan)."""
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)
    c = pid % n_chunks
    acc_t = tl.float64 if F64 else tl.float32
    offs_l = tl.arange(0, BLOCK_L)
    t = c * BLOCK_L + offs_l
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_t = t < L
    mask_w = offs_w < DW
    lg = tl.load(LG + n * L + t, mask=mask_t, other=0.0).to(acc_t)
    cum = tl.cumsum(lg, axis=0)
    if REVERSE:
        read = tl.exp(tl.sum(lg, axis=0) - cum)
        keep = offs_l[:, None] <= offs_l[None, :]
    else:
        read = tl.exp(cum)
        keep = offs_l[:, None] >= offs_l[None, :]
    o = tl.zeros((BLOCK_L, BLOCK_W), dtype=acc_t)
    A = tl.zeros((BLOCK_L, BLOCK_L), dtype=acc_t)
    for kb in range(0, tl.cdiv(DX, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < DX
        xy_mask = mask_t[:, None] & mask_k[None, :]
        x = tl.load(X + n * stride_xn + t[:, None] * stride_xl + offs_k[None, :], mask=xy_mask, other=0.0).to(acc_t)
        y = tl.load(Y + n * stride_xn + t[:, None] * stride_xl + offs_k[None, :], mask=xy_mask, other=0.0).to(acc_t)
        s = tl.load(H + n * stride_hn + c * stride_hc + offs_k[:, None] * DW + offs_w[None, :],
                    mask=mask_k[:, None] & mask_w[None, :], other=0.0)
        A = tl.dot(x, tl.trans(y), acc=A, input_precision=PREC, out_dtype=acc_t)
        o = tl.dot(x * read[:, None], s, acc=o, input_precision=PREC, out_dtype=acc_t)
    diff = cum[:, None] - cum[None, :]
    if REVERSE:
        diff = -diff
    A = tl.where(keep, A * tl.exp(tl.where(keep, diff, 0.0)), 0.0)      # masked before exp: no overflow
    w = tl.load(W + n * stride_wn + t[:, None] * stride_wl + offs_w[None, :],
                mask=mask_t[:, None] & mask_w[None, :], other=0.0).to(acc_t)
    o = tl.dot(A, w, acc=o, input_precision=PREC, out_dtype=acc_t)
    tl.store(OUT + n * stride_on + t[:, None] * stride_ol + offs_w[None, :], o.to(OUT.dtype.element_ty),
             mask=mask_t[:, None] & mask_w[None, :])


def _precision(acc: torch.dtype, *operands: Tensor) -> str:
    """``input_precision`` of the products (every operand is widened to ``acc`` first): IEEE for float32 and
    float64 inputs; for half-precision inputs tensor-core products of the widened operands, 3xTF32 when one is
    float16 (TF32 keeps float16's own 10-bit mantissa; see :mod:`attnkit_kernelized.linear.triton_ops`), TF32 for
    bfloat16 (coarser than TF32)."""
    if acc == torch.float64:
        return "ieee"
    if any(t.dtype == torch.float16 for t in operands):
        return "tf32x3"
    if any(t.dtype == torch.bfloat16 for t in operands):
        return "tf32"
    return "ieee"


#: positions per chunk: at most 64 (a (C x C) tile of decays per program)
_MAX_CHUNK = 64
#: ``(BLOCK_K, BLOCK_W, num_warps)`` of the state kernel, then of the output kernel, by product precision:
#: the linear kernels' tiles (chosen there with ptxas for sm_90, no spills), not tuned for these kernels.
#: BLOCK_K, BLOCK_W shrink to the widths (not below 16), and on ``OutOfResources`` (:func:`.._triton_fit.launch`).
_TILES = {"tf32": ((64, 64, 4), (64, 64, 8)),
          "tf32x3": ((64, 64, 4), (64, 64, 8)),
          "ieee": ((64, 32, 8), (64, 32, 8)),
          "float64": ((64, 32, 8), (32, 32, 8))}


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
    prec = _precision(acc, x, y, w)
    block_l = _block(chunk, _MAX_CHUNK)
    n_chunks = triton.cdiv(L, block_l)
    out = torch.empty(N, L, DW, dtype=acc, device=x.device)
    SF = torch.empty(N, DX, DW, dtype=acc, device=x.device)
    H = torch.empty(N, n_chunks, DX, DW, dtype=acc, device=x.device)   # chunk contributions, then entering states
    if not N:
        return out, SF
    (bk, bw, warps_state), (bk_out, bw_out, warps_out) = _TILES["float64" if acc == torch.float64 else prec]
    consts = dict(BLOCK_L=block_l, F64=acc == torch.float64)
    hs = (H.stride(0), H.stride(1))
    if n_chunks:
        launch(_gated_state_kernel,
               lambda m: (N * n_chunks, triton.cdiv(DX, m["BLOCK_K"]), triton.cdiv(DW, m["BLOCK_W"])),
               (y, w, log_g, H, L, DX, DW, n_chunks, y.stride(0), y.stride(1), w.stride(0), w.stride(1), *hs),
               dict(BLOCK_K=_block(DX, bk), BLOCK_W=_block(DW, bw), REVERSE=reverse, PREC=prec,
                    num_warps=warps_state, **consts), shrink=("BLOCK_K", "BLOCK_W"))
    scan = dict(BLOCK_K=_block(DX, 32), BLOCK_W=_block(DW, 64))
    _gated_scan_kernel[(N, triton.cdiv(DX, scan["BLOCK_K"]), triton.cdiv(DW, scan["BLOCK_W"]))](
        log_g, S0, H, SF, L, DX, DW, n_chunks, *hs, REVERSE=reverse, num_warps=4, **scan, **consts)
    if n_chunks:
        launch(_gated_out_kernel, lambda m: (N * n_chunks, triton.cdiv(DW, m["BLOCK_W"])),
               (x, y, w, log_g, H, out, L, DX, DW, n_chunks, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                out.stride(0), out.stride(1), *hs),
               dict(BLOCK_K=_block(DX, bk_out), BLOCK_W=_block(DW, bw_out), REVERSE=reverse, PREC=prec,
                    num_warps=warps_out, **consts), shrink=("BLOCK_K", "BLOCK_W"))
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
