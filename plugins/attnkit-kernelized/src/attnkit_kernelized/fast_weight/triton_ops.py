"""triton kernels (CUDA) of the delta rule (``fast-weight``): the chunked UT-transform form, forward and backward.

The delta rule ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``, ``out_t = S_t^T q_t``
in chunks of ``C`` positions, with the same structure as the chunked torch form
(:mod:`.chunk`, DeltaNet's WY / UT transform, Yang et al. 2024, arXiv 2406.06484).
Per chunk, from its starting state ``S``::

    T = (I + tril(diag(beta) K K^T, -1))^{-1}      (forward substitution as C - 1 products, in registers)
    u = T diag(beta) (V - K S);   out = Q S + tril(Q K^T) u;   S <- S + K^T u

``_delta_forward_kernel``: one program per (sequence, block of value columns;
the columns never mix) walks the chunks in order with ``S`` in registers and
stores ``S`` at every chunk start (the checkpoints of the backward pass,
``O(L/C · M·E)`` memory).

The backward pass is a triton kernel too, ``_delta_backward_kernel``: the
chunks in reverse, each chunk's starting state read from its checkpoint, the
chunk's own gradients in matrix form, ``G`` (the gradient of the state at the
chunk's end) carried in registers::

    du = tril(Q K^T)^T dO + K G;   dr = T^T du;   Z = tril(-dr u^T, -1)
    dQ = tril(dO u^T) K + dO S^T
    dK = tril(dO u^T)^T Q + u G^T + (diag(beta) Z) K + (diag(beta) Z)^T K - diag(beta) dr S^T
    dV = diag(beta) dr;  d beta = rowsum(Z * K K^T) + rowsum(dr * (V - K S))
    G  <- G + Q^T dO - K^T diag(beta) dr

Programs over blocks of value columns write their partial ``dQ``, ``dK``,
``d beta`` (sums over the columns) to separate buffers, summed afterwards.
Everything accumulates in float32 (float64 for float64 inputs), with IEEE (not
TF32) products: half-precision inputs keep a float32 state. This module imports
triton at import time; it is imported only when the ``triton`` backend runs.
On CPU tensors it runs under ``TRITON_INTERPRET=1`` (set before the first
import); timings need a CUDA device.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``triton_delta_rule`` (differentiable) and ``triton_delta_backward``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._ops import define
from .._triton_fit import launch
from ..common import DEFAULT_CHUNK


@triton.jit
def _inverse_unit_lower(Lm, offs_l, BLOCK_L: tl.constexpr):
    """``(I + Lm)^{-1}`` of a strictly lower triangular ``Lm``: ``T <- I - Lm T``, ``BLOCK_L - 1`` times.

    Row ``i`` of ``I - Lm T`` reads only rows ``j < i`` of ``T``; once those hold the inverse, row ``i`` is
    forward substitution's ``T_i = e_i - sum_{j < i} Lm[i, j] T_j`` (the same arithmetic, so just as stable), and
    after iteration ``i`` rows ``0..i`` are final. One ``(C x C)`` product per step instead of row extractions.
    """
    eye = tl.where(offs_l[:, None] == offs_l[None, :], 1.0, 0.0).to(Lm.dtype)
    Ti = eye
    for _ in range(1, BLOCK_L):
        Ti = eye - tl.dot(Lm, Ti, input_precision="ieee", out_dtype=Lm.dtype)
    return Ti


@triton.jit
def _chunk_setup(Q, K, V, BETA, n, c, L, M, E, offs_l, offs_m, offs_e, stride_qn, stride_ql, stride_vn, stride_vl,
                 F64: tl.constexpr, BLOCK_L: tl.constexpr):
    """Load chunk ``c`` of sequence ``n``: ``q, k (C, M)``, ``v (C, BE)``, ``b (C)`` (zeros past L), ``K K^T``
    and ``T = (I + tril(diag(b) K K^T, -1))^{-1}``."""
    acc_t = tl.float64 if F64 else tl.float32
    t = c * BLOCK_L + offs_l
    mask_t = t < L
    qk_mask = mask_t[:, None] & (offs_m < M)[None, :]
    q = tl.load(Q + n * stride_qn + t[:, None] * stride_ql + offs_m[None, :], mask=qk_mask, other=0.0).to(acc_t)
    k = tl.load(K + n * stride_qn + t[:, None] * stride_ql + offs_m[None, :], mask=qk_mask, other=0.0).to(acc_t)
    v = tl.load(V + n * stride_vn + t[:, None] * stride_vl + offs_e[None, :],
                mask=mask_t[:, None] & (offs_e < E)[None, :], other=0.0).to(acc_t)
    b = tl.load(BETA + n * L + t, mask=mask_t, other=0.0).to(acc_t)
    KK = tl.dot(k, tl.trans(k), input_precision="ieee", out_dtype=acc_t)
    strict = offs_l[:, None] > offs_l[None, :]
    Ti = _inverse_unit_lower(tl.where(strict, b[:, None] * KK, 0.0), offs_l, BLOCK_L)
    return t, mask_t, q, k, v, b, KK, Ti


@triton.jit
def _delta_forward_kernel(Q, K, V, BETA, S0, OUT, SF, CK, L, M, E, n_chunks,
                          stride_qn, stride_ql, stride_vn, stride_vl, stride_on, stride_ol,
                          BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, F64: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)     # offsets in int64: B·H·L·M may pass 2^31
    pid_e = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    offs_l = tl.arange(0, BLOCK_L)
    offs_m = tl.arange(0, BLOCK_M)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    s_ptrs = offs_m[:, None] * E + offs_e[None, :]
    s_mask = (offs_m < M)[:, None] & (offs_e < E)[None, :]
    S = tl.load(S0 + n * M * E + s_ptrs, mask=s_mask, other=0.0).to(acc_t)
    incl = offs_l[:, None] >= offs_l[None, :]
    for c in range(0, n_chunks):
        t, mask_t, q, k, v, b, KK, Ti = _chunk_setup(
            Q, K, V, BETA, n, c, L, M, E, offs_l, offs_m, offs_e, stride_qn, stride_ql, stride_vn, stride_vl,
            F64, BLOCK_L)
        tl.store(CK + (n * n_chunks + c) * M * E + s_ptrs, S.to(CK.dtype.element_ty), mask=s_mask)
        r = b[:, None] * (v - tl.dot(k, S, input_precision="ieee", out_dtype=acc_t))
        u = tl.dot(Ti, r, input_precision="ieee", out_dtype=acc_t)
        P = tl.where(incl, tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=acc_t), 0.0)
        o = tl.dot(q, S, input_precision="ieee", out_dtype=acc_t) + tl.dot(P, u, input_precision="ieee",
                                                                           out_dtype=acc_t)
        tl.store(OUT + n * stride_on + t[:, None] * stride_ol + offs_e[None, :], o.to(OUT.dtype.element_ty),
                 mask=mask_t[:, None] & (offs_e < E)[None, :])
        S += tl.dot(tl.trans(k), u, input_precision="ieee", out_dtype=acc_t)
    tl.store(SF + n * M * E + s_ptrs, S.to(SF.dtype.element_ty), mask=s_mask)


@triton.jit
def _delta_backward_kernel(Q, K, V, BETA, CK, DO, DSF, DQ, DK, DV, DB, DS0, N, L, M, E, n_chunks,
                           stride_qn, stride_ql, stride_vn, stride_vl,
                           BLOCK_L: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, F64: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)     # offsets in int64: B·H·L·M may pass 2^31
    pid_e = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    offs_l = tl.arange(0, BLOCK_L)
    offs_m = tl.arange(0, BLOCK_M)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    s_ptrs = offs_m[:, None] * E + offs_e[None, :]
    s_mask = (offs_m < M)[:, None] & (offs_e < E)[None, :]
    G = tl.load(DSF + n * M * E + s_ptrs, mask=s_mask, other=0.0).to(acc_t)
    incl = offs_l[:, None] >= offs_l[None, :]
    strict = offs_l[:, None] > offs_l[None, :]
    part = pid_e * N + n                                   # this program's slice of the partial buffers
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        t, mask_t, q, k, v, b, KK, Ti = _chunk_setup(
            Q, K, V, BETA, n, c, L, M, E, offs_l, offs_m, offs_e, stride_qn, stride_ql, stride_vn, stride_vl,
            F64, BLOCK_L)
        e_mask = mask_t[:, None] & (offs_e < E)[None, :]
        m_mask = mask_t[:, None] & (offs_m < M)[None, :]
        S = tl.load(CK + (n * n_chunks + c) * M * E + s_ptrs, mask=s_mask, other=0.0).to(acc_t)
        dO = tl.load(DO + n * stride_vn + t[:, None] * stride_vl + offs_e[None, :], mask=e_mask,
                     other=0.0).to(acc_t)
        Vm = v - tl.dot(k, S, input_precision="ieee", out_dtype=acc_t)
        u = tl.dot(Ti, b[:, None] * Vm, input_precision="ieee", out_dtype=acc_t)
        P = tl.where(incl, tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=acc_t), 0.0)
        du = (tl.dot(tl.trans(P), dO, input_precision="ieee", out_dtype=acc_t)
              + tl.dot(k, G, input_precision="ieee", out_dtype=acc_t))
        dP = tl.where(incl, tl.dot(dO, tl.trans(u), input_precision="ieee", out_dtype=acc_t), 0.0)
        dr = tl.dot(tl.trans(Ti), du, input_precision="ieee", out_dtype=acc_t)
        Z = tl.where(strict, -tl.dot(dr, tl.trans(u), input_precision="ieee", out_dtype=acc_t), 0.0)
        Zb = b[:, None] * Z
        bdr = b[:, None] * dr
        dq = (tl.dot(dP, k, input_precision="ieee", out_dtype=acc_t)
              + tl.dot(dO, tl.trans(S), input_precision="ieee", out_dtype=acc_t))
        dk = (tl.dot(tl.trans(dP), q, input_precision="ieee", out_dtype=acc_t)
              + tl.dot(u, tl.trans(G), input_precision="ieee", out_dtype=acc_t)
              + tl.dot(Zb + tl.trans(Zb), k, input_precision="ieee", out_dtype=acc_t)
              - tl.dot(bdr, tl.trans(S), input_precision="ieee", out_dtype=acc_t))
        db = tl.sum(Z * KK, axis=1) + tl.sum(dr * Vm, axis=1)
        m_ptrs = part * L * M + t[:, None] * M + offs_m[None, :]
        tl.store(DQ + m_ptrs, dq.to(DQ.dtype.element_ty), mask=m_mask)
        tl.store(DK + m_ptrs, dk.to(DK.dtype.element_ty), mask=m_mask)
        tl.store(DB + part * L + t, db.to(DB.dtype.element_ty), mask=mask_t)
        tl.store(DV + n * L * E + t[:, None] * E + offs_e[None, :], bdr.to(DV.dtype.element_ty), mask=e_mask)
        G += (tl.dot(tl.trans(q), dO, input_precision="ieee", out_dtype=acc_t)
              - tl.dot(tl.trans(k), bdr, input_precision="ieee", out_dtype=acc_t))
    tl.store(DS0 + n * M * E + s_ptrs, G.to(DS0.dtype.element_ty), mask=s_mask)


# ------------------------------------------------------------------ launch helpers
def _block(n: int, cap: int | None = None) -> int:
    b = max(16, triton.next_power_of_2(max(n, 1)))
    return min(b, cap) if cap else b


def _acc_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (the state's and the accumulation's dtype)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _plan(L: int, M: int, E: int, chunk: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_L, BLOCK_M, BLOCK_E, n_chunks, n_e)``: chunk rounded up to a power of two >= 16."""
    if chunk < 1:
        raise ValueError(f"triton_delta_rule: chunk: expected an int >= 1, got {chunk}")
    block_l, block_m, block_e = _block(chunk), _block(M), _block(E, 64)
    return block_l, block_m, block_e, triton.cdiv(L, block_l), triton.cdiv(max(E, 1), block_e)


def _seq(x: Tensor) -> Tensor:
    """``(B, H, ...)`` -> contiguous ``(B*H, ...)``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S0: Tensor,
             chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    N = B * H
    acc = _acc_dtype(phi_q, S0)
    block_l, block_m, block_e, nc, ne = _plan(L, M, E, chunk)
    q, k, w, b, S0n = (_seq(t) for t in (phi_q, phi_k, v, beta, S0))
    out = torch.empty(N, L, E, dtype=v.dtype, device=v.device)
    SF = torch.empty(N, M, E, dtype=acc, device=v.device)
    ck = torch.empty(N, nc, M, E, dtype=acc, device=v.device)
    if N and E:
        # the tiles fix the checkpoints' layout and the buffers: only the pipeline depth may give way
        launch(_delta_forward_kernel, lambda m: (N, ne), (
            q, k, w, b, S0n, out, SF, ck, L, M, E, nc, q.stride(0), q.stride(1), w.stride(0), w.stride(1),
            out.stride(0), out.stride(1)), dict(BLOCK_L=block_l, BLOCK_M=block_m, BLOCK_E=block_e,
                                                F64=acc == torch.float64, num_warps=8 if block_m >= 128 else 4))
    else:
        SF.copy_(S0n)
    return out.view(B, H, L, E), SF.view(B, H, M, E), ck.view(B, H, nc, M, E)


def _forward_fake(phi_q, phi_k, v, beta, S0, chunk):
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    acc = _acc_dtype(phi_q, S0)
    nc = _plan(L, M, E, chunk)[3]
    return v.new_empty(B, H, L, E), S0.new_empty(B, H, M, E, dtype=acc), v.new_empty(B, H, nc, M, E, dtype=acc)


def _backward_impl(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, ckpt: Tensor, dout: Tensor, dS: Tensor,
                   chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    N = B * H
    acc = ckpt.dtype
    block_l, block_m, block_e, nc, ne = _plan(L, M, E, chunk)
    q, k, w, b, ck, do, dSn = (_seq(t) for t in (phi_q, phi_k, v, beta, ckpt, dout, dS.to(acc)))
    dq = torch.zeros(ne, N, L, M, dtype=acc, device=v.device)
    dk = torch.zeros(ne, N, L, M, dtype=acc, device=v.device)
    db = torch.zeros(ne, N, L, dtype=acc, device=v.device)
    dv = torch.empty(N, L, E, dtype=acc, device=v.device)
    dS0 = torch.empty(N, M, E, dtype=acc, device=v.device)
    if N and E:
        launch(_delta_backward_kernel, lambda m: (N, ne), (
            q, k, w, b, ck, do, dSn, dq, dk, dv, db, dS0, N, L, M, E, nc, q.stride(0), q.stride(1), w.stride(0),
            w.stride(1)), dict(BLOCK_L=block_l, BLOCK_M=block_m, BLOCK_E=block_e, F64=acc == torch.float64,
                               num_warps=8 if block_m >= 128 else 4))
    else:
        dS0.copy_(dSn)
    return (dq.sum(0).view(B, H, L, M).to(phi_q.dtype), dk.sum(0).view(B, H, L, M).to(phi_k.dtype),
            dv.view(B, H, L, E).to(v.dtype), db.sum(0).view(B, H, L).to(beta.dtype), dS0.view(B, H, M, E).to(dS.dtype))


def _backward_fake(phi_q, phi_k, v, beta, ckpt, dout, dS, chunk):
    return tuple(torch.empty_like(t) for t in (phi_q, phi_k, v, beta, dS))


#: ``attnkit_kernelized::triton_delta_backward``: gradients of :data:`triton_delta_rule`
triton_delta_backward = define("triton_delta_backward", _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output):
    phi_q, phi_k, v, beta, S0, chunk = inputs
    ctx.save_for_backward(phi_q, phi_k, v, beta, output[2])
    ctx.chunk = chunk
    ctx.S0_dtype = S0.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, g_out, g_S, _g_ckpt):
    phi_q, phi_k, v, beta, ckpt = ctx.saved_tensors
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    g_out = v.new_zeros(B, H, L, E) if g_out is None else g_out.contiguous()
    g_S = ckpt.new_zeros(B, H, M, E) if g_S is None else g_S.contiguous()
    dq, dk, dv, db, dS0 = triton_delta_backward(phi_q, phi_k, v, beta, ckpt, g_out, g_S, ctx.chunk)
    return dq, dk, dv, db, dS0.to(ctx.S0_dtype), None


#: ``attnkit_kernelized::triton_delta_rule``: ``(phi_q, phi_k, v, beta, S0, chunk) -> (out, S, checkpoints)``
#: (the state and checkpoints float32 for half-precision inputs), differentiable in the first five inputs
triton_delta_rule = define("triton_delta_rule", _forward, _forward_fake, backward=_backward,
                           setup_context=_setup_context)


def delta_rule(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S0: Tensor | None = None, *,
               chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """The delta rule with the triton kernels (the ``triton`` backend of ``fast-weight``; differentiable).

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``; beta: ``(B, H, L)``; CUDA tensors (or CPU tensors
            under ``TRITON_INTERPRET=1``), float16/bfloat16/float32/float64.
        S0: the state ``(B, H, M, E)`` carried in (None: zeros).
        chunk: positions per chunk (rounded up to a power of two >= 16).

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E))``: ``out`` in the dtype of ``v``; the state accumulated and returned
        in float32 for half-precision inputs (float64 for float64).
    """
    B, H, L, M = phi_q.shape
    acc = _acc_dtype(phi_q, v)
    S0 = phi_q.new_zeros(B, H, M, v.shape[-1], dtype=acc) if S0 is None else S0.to(acc)
    out, S, _ = triton_delta_rule(phi_q, phi_k, v, beta, S0, chunk)
    return out, S
