"""triton kernels (CUDA) of the delta rule (``fast-weight``): the chunked WY / UT-transform form, forward and backward.

The delta rule ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``, ``out_t = S_t^T q_t``
in chunks of ``C`` positions (DeltaNet's WY / UT transform, Yang et al. 2024,
arXiv 2406.06484; the same algorithm as the torch form :mod:`.chunk`). Per
chunk, with ``S`` the state before it::

    T = (I + tril(diag(beta) K K^T, -1))^{-1};   W = T diag(beta) K;   U = T diag(beta) V
    u = U - W S;   out = Q S + tril(Q K^T) u;   S <- S + K^T u

Forward, three kernels; only the second walks the chunks in order:

1. ``_wy_kernel``, one program per (sequence, chunk): ``K K^T`` over blocks of
   features, ``T`` by forward substitution in registers (one ``O(C^2)`` row
   update per row, ``O(C^3)`` per chunk), then ``W`` and ``U`` block by block.
   Stores ``T`` ``(N, chunks, C, C)``, ``W`` ``(N, L, M)``, ``U`` ``(N, L, E)``.
2. ``_state_kernel``, one program per (sequence, block of value columns; the
   columns never mix), the chunks in order, two products per chunk
   (``u = U - W S``, ``S += K^T u``). The states live in ``CK`` ``(N, chunks + 1, M, E)``
   (slot ``c``: the state before chunk ``c``; slot 0 ``S0``, the last the final
   state), read and written in ``(BLOCK_K, BLOCK_E)`` blocks through global memory
   (not a full ``(M, BLOCK_E)`` register tile, which spilled), a barrier between chunks;
   stores ``u`` ``(N, L, E)``.
3. the output ``out = Q S_c + tril(Q K^T) u``, every (sequence, chunk) at once:
   the linear kernels' ``_chunk_out_kernel`` (:mod:`..linear.triton_ops`) with
   the slots of ``CK`` as its prefix states and ``u`` as its values.

Backward, four kernels; only the second walks the chunks (in reverse):

1. ``_bwd_local_kernel``, per (sequence and chunk, value block): ``dU_loc = tril(Q K^T)^T dO``;
2. ``_bwd_state_kernel``, per (sequence, value block): ``G`` (slot ``s`` of ``DH``: the
   gradient of the state before chunk ``s``; the last slot the final state's),
   ``du = dU_loc + K G_{c+1}``, ``G_c = G_{c+1} + Q^T dO - W^T du`` through global
   memory as in the forward; slot 0 is the gradient of ``S0``;
3. ``_bwd_intra_kernel``, per (sequence, chunk): ``dr = T^T du``, ``dV = diag(beta) dr``,
   the ``(C, C)`` sums ``dP = tril(dO u^T)`` and ``Z = tril(-dr u^T, -1)`` (stored) and
   ``rowsum(dr * V)``;
4. ``_bwd_chunk_kernel``, per (sequence and chunk, feature block), the value
   columns in blocks inside::

       dQ = dP K + dO S^T
       dK = dP^T Q + u G^T + (diag(beta) Z + (diag(beta) Z)^T) K - diag(beta) dr S^T
       d beta = rowsum(Z * K K^T) + rowsum(dr * V) - rowsum((dr S^T) * K)

   (``d beta`` summed over the feature blocks afterwards).

The forward keeps ``T``, ``W``, ``u`` and the chunk states for the backward
(``N·L·(C + M + E) + N·(L/C + 1)·M·E`` values in the accumulation dtype) instead of
recomputing them. Tiles per operand kind: :data:`_TILES` (chosen with ptxas for sm_90, untimed).

Precision: every state, ``T``, ``W``, ``U``, ``u`` and gradient is float32 for
half-precision inputs (float64 for float64). Forward with float16 inputs
(bfloat16 on CUDA): ``K K^T`` and ``Q K^T`` take the half operands as they are
(tensor cores, float32 sums); every product with a computed float32 factor is
TF32 (the half operand widened exactly). The backward widens half inputs to
float32 before its kernels (TF32 products). float32 inputs: IEEE products;
float64: float64. This module imports triton at import time; it is imported
only when the ``triton`` backend runs. On CPU tensors it runs under
``TRITON_INTERPRET=1`` (set before the first import); timings need a CUDA
device.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``triton_delta_rule`` (differentiable) and ``triton_delta_backward``.
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
from ..common import DEFAULT_CHUNK
from ..linear.triton_ops import _TILES as _LINEAR_TILES
from ..linear.triton_ops import _chunk_out_kernel, _lowp, _meta


@triton.jit
def _solve_unit_lower(A, offs_l, BLOCK_L: tl.constexpr):
    """``(I + A)^{-1}`` of a strictly lower triangular ``A`` ``(C, C)`` by forward substitution.

    ``X = (I + A)^{-1} - I`` is strictly lower and solves ``X = -A - A X``: row ``i`` is
    ``X_i = -A_i - sum_{j < i} A_ij X_j``, which reads only rows ``j < i``, final once processed in order.
    Row ``i`` is extracted with a masked sum and updated with one broadcast product: ``O(C^2)`` per row.
    """
    X = -A
    for i in range(1, BLOCK_L):
        a = tl.sum(tl.where(offs_l[:, None] == i, X, 0.0), axis=0)           # -A_i (row i not yet updated)
        a = a + tl.sum(a[:, None] * X, axis=0)                               # + sum_j (-A_ij) X_j
        X = tl.where(offs_l[:, None] == i, a[None, :], X)
    return X + tl.where(offs_l[:, None] == offs_l[None, :], 1.0, 0.0).to(X.dtype)


@triton.jit
def _wy_kernel(K, V, BETA, TM, WB, UB, L, M, E, n_chunks, stride_kn, stride_kl, stride_vn, stride_vl,
               BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, F64: tl.constexpr,
               LOWP: tl.constexpr, PREC: tl.constexpr):
    # per (sequence, chunk): T = (I + tril(diag(b) K K^T, -1))^{-1}, W = T diag(b) K, U = T diag(b) V
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)     # offsets in int64: N·L·M may pass 2^31
    c = pid % n_chunks
    acc_t = tl.float64 if F64 else tl.float32
    offs_l = tl.arange(0, BLOCK_L)
    t = c * BLOCK_L + offs_l
    mask_t = t < L
    b = tl.load(BETA + n * L + t, mask=mask_t, other=0.0).to(acc_t)
    KK = tl.zeros((BLOCK_L, BLOCK_L), dtype=acc_t)
    for kb in range(0, tl.cdiv(M, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k = tl.load(K + n * stride_kn + t[:, None] * stride_kl + offs_k[None, :],
                    mask=mask_t[:, None] & (offs_k < M)[None, :], other=0.0)
        if LOWP:    # half-precision operands as they are: tensor cores, float32 sums
            KK = tl.dot(k, tl.trans(k), acc=KK, out_dtype=tl.float32)
        else:
            k = k.to(acc_t)
            KK = tl.dot(k, tl.trans(k), acc=KK, input_precision=PREC, out_dtype=acc_t)
    strict = offs_l[:, None] > offs_l[None, :]
    Tm = _solve_unit_lower(tl.where(strict, b[:, None] * KK, 0.0), offs_l, BLOCK_L)
    tl.store(TM + (n * n_chunks + c) * BLOCK_L * BLOCK_L + offs_l[:, None] * BLOCK_L + offs_l[None, :],
             Tm.to(TM.dtype.element_ty))
    for kb in range(0, tl.cdiv(M, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        m_mask = mask_t[:, None] & (offs_k < M)[None, :]
        k = tl.load(K + n * stride_kn + t[:, None] * stride_kl + offs_k[None, :], mask=m_mask, other=0.0)
        w = tl.dot(Tm, b[:, None] * k.to(acc_t), input_precision=PREC, out_dtype=acc_t)
        tl.store(WB + n * L * M + t[:, None] * M + offs_k[None, :], w.to(WB.dtype.element_ty), mask=m_mask)
    for eb in range(0, tl.cdiv(E, BLOCK_E)):
        offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
        e_mask = mask_t[:, None] & (offs_e < E)[None, :]
        v = tl.load(V + n * stride_vn + t[:, None] * stride_vl + offs_e[None, :], mask=e_mask, other=0.0)
        u = tl.dot(Tm, b[:, None] * v.to(acc_t), input_precision=PREC, out_dtype=acc_t)
        tl.store(UB + n * L * E + t[:, None] * E + offs_e[None, :], u.to(UB.dtype.element_ty), mask=e_mask)


@triton.jit
def _state_kernel(K, WB, UB, CK, UN, L, M, E, n_chunks, stride_kn, stride_kl,
                  BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, F64: tl.constexpr,
                  PREC: tl.constexpr):
    # per (sequence, value block), chunks in order: u = U - W S, then S <- S + K^T u from slot c to slot c + 1
    # of CK (slot 0 holds S0); the state goes through global memory (L2) in (BLOCK_K, BLOCK_E) blocks, so the
    # registers hold three tiles whatever the number of features
    n = tl.program_id(0).to(tl.int64)
    pid_e = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    offs_l = tl.arange(0, BLOCK_L)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    for c in range(0, n_chunks):
        t = c * BLOCK_L + offs_l
        mask_t = t < L
        e_mask = mask_t[:, None] & (offs_e < E)[None, :]
        state = (n * (n_chunks + 1) + c) * M * E
        u = tl.load(UB + n * L * E + t[:, None] * E + offs_e[None, :], mask=e_mask, other=0.0)
        for kb in range(0, tl.cdiv(M, BLOCK_K)):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            s_ptrs = offs_k[:, None] * E + offs_e[None, :]
            s_mask = (offs_k < M)[:, None] & (offs_e < E)[None, :]
            S = tl.load(CK + state + s_ptrs, mask=s_mask, other=0.0)
            w = tl.load(WB + n * L * M + t[:, None] * M + offs_k[None, :], mask=mask_t[:, None] & (offs_k < M)[None, :],
                        other=0.0)
            u -= tl.dot(w, S, input_precision=PREC, out_dtype=acc_t)
        tl.store(UN + n * L * E + t[:, None] * E + offs_e[None, :], u.to(UN.dtype.element_ty), mask=e_mask)
        for kb in range(0, tl.cdiv(M, BLOCK_K)):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            s_ptrs = offs_k[:, None] * E + offs_e[None, :]
            s_mask = (offs_k < M)[:, None] & (offs_e < E)[None, :]
            S = tl.load(CK + state + s_ptrs, mask=s_mask, other=0.0)
            k = tl.load(K + n * stride_kn + t[:, None] * stride_kl + offs_k[None, :],
                        mask=mask_t[:, None] & (offs_k < M)[None, :], other=0.0).to(acc_t)
            S = tl.dot(tl.trans(k), u, acc=S, input_precision=PREC, out_dtype=acc_t)
            tl.store(CK + state + M * E + s_ptrs, S.to(CK.dtype.element_ty), mask=s_mask)
        tl.debug_barrier()     # slot c + 1, written by every thread of the program, is read by others next


@triton.jit
def _bwd_local_kernel(Q, K, DO, DUL, L, M, E, n_chunks,
                      BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr):
    # per (sequence and chunk, value block): dU_loc = tril(Q K^T)^T dO (the in-chunk part of du)
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)
    c = pid % n_chunks
    pid_e = tl.program_id(1)
    acc_t = DUL.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    t = c * BLOCK_L + offs_l
    mask_t = t < L
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = mask_t[:, None] & (offs_e < E)[None, :]
    PT = tl.zeros((BLOCK_L, BLOCK_L), dtype=acc_t)                # (Q K^T)^T = K Q^T
    for kb in range(0, tl.cdiv(M, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        m_mask = mask_t[:, None] & (offs_k < M)[None, :]
        q = tl.load(Q + n * L * M + t[:, None] * M + offs_k[None, :], mask=m_mask, other=0.0)
        k = tl.load(K + n * L * M + t[:, None] * M + offs_k[None, :], mask=m_mask, other=0.0)
        PT = tl.dot(k, tl.trans(q), acc=PT, input_precision=PREC, out_dtype=acc_t)
    PT = tl.where(offs_l[:, None] <= offs_l[None, :], PT, 0.0)
    dO = tl.load(DO + n * L * E + t[:, None] * E + offs_e[None, :], mask=e_mask, other=0.0)
    du = tl.dot(PT, dO, input_precision=PREC, out_dtype=acc_t)
    tl.store(DUL + n * L * E + t[:, None] * E + offs_e[None, :], du, mask=e_mask)


@triton.jit
def _bwd_state_kernel(Q, K, WB, DO, DUL, DH, DU, L, M, E, n_chunks,
                      BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr):
    # per (sequence, value block), chunks in reverse, G (the gradient of the state before chunk s) at slot s of
    # DH (slot n_chunks: the final state's): du = dU_loc + K G, then G <- G + Q^T dO - W^T du from slot c + 1 to
    # slot c, in (BLOCK_K, BLOCK_E) blocks through global memory as in _state_kernel
    n = tl.program_id(0).to(tl.int64)
    pid_e = tl.program_id(1)
    acc_t = DH.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    for i in range(0, n_chunks):
        c = n_chunks - 1 - i
        t = c * BLOCK_L + offs_l
        mask_t = t < L
        e_mask = mask_t[:, None] & (offs_e < E)[None, :]
        e_ptrs = n * L * E + t[:, None] * E + offs_e[None, :]
        after = (n * (n_chunks + 1) + c + 1) * M * E
        du = tl.load(DUL + e_ptrs, mask=e_mask, other=0.0)
        for kb in range(0, tl.cdiv(M, BLOCK_K)):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            g_ptrs = offs_k[:, None] * E + offs_e[None, :]
            g_mask = (offs_k < M)[:, None] & (offs_e < E)[None, :]
            G = tl.load(DH + after + g_ptrs, mask=g_mask, other=0.0)
            k = tl.load(K + n * L * M + t[:, None] * M + offs_k[None, :], mask=mask_t[:, None] & (offs_k < M)[None, :],
                        other=0.0)
            du = tl.dot(k, G, acc=du, input_precision=PREC, out_dtype=acc_t)
        tl.store(DU + e_ptrs, du, mask=e_mask)
        dO = tl.load(DO + e_ptrs, mask=e_mask, other=0.0)
        for kb in range(0, tl.cdiv(M, BLOCK_K)):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            g_ptrs = offs_k[:, None] * E + offs_e[None, :]
            g_mask = (offs_k < M)[:, None] & (offs_e < E)[None, :]
            m_ptrs = n * L * M + t[:, None] * M + offs_k[None, :]
            m_mask = mask_t[:, None] & (offs_k < M)[None, :]
            G = tl.load(DH + after + g_ptrs, mask=g_mask, other=0.0)
            q = tl.load(Q + m_ptrs, mask=m_mask, other=0.0)
            w = tl.load(WB + m_ptrs, mask=m_mask, other=0.0)
            G = tl.dot(tl.trans(q), dO, acc=G, input_precision=PREC, out_dtype=acc_t)
            G -= tl.dot(tl.trans(w), du, input_precision=PREC, out_dtype=acc_t)
            tl.store(DH + after - M * E + g_ptrs, G, mask=g_mask)
        tl.debug_barrier()     # slot c, written by every thread of the program, is read by others next


@triton.jit
def _bwd_intra_kernel(V, BETA, TM, UN, DO, DU, DR, DPB, ZB, DV, DB, L, E, n_chunks,
                      BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr):
    # per (sequence, chunk), the value columns in blocks: dr = T^T du (stored), dV = diag(b) dr, the (C, C)
    # sums dP = tril(dO u^T) and Z = tril(-dr u^T, -1) (stored), and d beta's rowsum(dr * V)
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)
    c = pid % n_chunks
    acc_t = DR.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    t = c * BLOCK_L + offs_l
    mask_t = t < L
    b = tl.load(BETA + n * L + t, mask=mask_t, other=0.0)
    cc = (n * n_chunks + c) * BLOCK_L * BLOCK_L + offs_l[:, None] * BLOCK_L + offs_l[None, :]
    Tm = tl.load(TM + cc)
    dP = tl.zeros((BLOCK_L, BLOCK_L), dtype=acc_t)      # dO u^T
    Z = tl.zeros((BLOCK_L, BLOCK_L), dtype=acc_t)       # dr u^T
    db = tl.zeros((BLOCK_L,), dtype=acc_t)
    for eb in range(0, tl.cdiv(E, BLOCK_E)):
        offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
        e_mask = mask_t[:, None] & (offs_e < E)[None, :]
        e_ptrs = n * L * E + t[:, None] * E + offs_e[None, :]
        u = tl.load(UN + e_ptrs, mask=e_mask, other=0.0)
        du = tl.load(DU + e_ptrs, mask=e_mask, other=0.0)
        dO = tl.load(DO + e_ptrs, mask=e_mask, other=0.0)
        v = tl.load(V + e_ptrs, mask=e_mask, other=0.0)
        dr = tl.dot(tl.trans(Tm), du, input_precision=PREC, out_dtype=acc_t)
        dP = tl.dot(dO, tl.trans(u), acc=dP, input_precision=PREC, out_dtype=acc_t)
        Z = tl.dot(dr, tl.trans(u), acc=Z, input_precision=PREC, out_dtype=acc_t)
        db += tl.sum(dr * v, axis=1)
        tl.store(DR + e_ptrs, dr, mask=e_mask)
        tl.store(DV + e_ptrs, b[:, None] * dr, mask=e_mask)
    dP = tl.where(offs_l[:, None] >= offs_l[None, :], dP, 0.0)
    Z = tl.where(offs_l[:, None] > offs_l[None, :], -Z, 0.0)
    tl.store(DPB + cc, dP)
    tl.store(ZB + cc, Z)
    tl.store(DB + n * L + t, db, mask=mask_t)


@triton.jit
def _bwd_chunk_kernel(Q, K, BETA, CK, UN, DO, DH, DR, DPB, ZB, DQ, DK, DB, N, L, M, E, n_chunks,
                      BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PREC: tl.constexpr):
    # per (sequence and chunk, feature block): dQ and dK of the block and its share of d beta
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)
    c = pid % n_chunks
    pid_k = tl.program_id(1)
    acc_t = DQ.dtype.element_ty
    offs_l = tl.arange(0, BLOCK_L)
    t = c * BLOCK_L + offs_l
    mask_t = t < L
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_mask = mask_t[:, None] & (offs_k < M)[None, :]
    state = (n * (n_chunks + 1) + c) * M * E          # slot c of CK: the state before the chunk
    dq = tl.zeros((BLOCK_L, BLOCK_K), dtype=acc_t)      # dO S^T
    dk = tl.zeros((BLOCK_L, BLOCK_K), dtype=acc_t)      # u G^T
    drS = tl.zeros((BLOCK_L, BLOCK_K), dtype=acc_t)     # dr S^T
    for eb in range(0, tl.cdiv(E, BLOCK_E)):
        offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
        e_mask = mask_t[:, None] & (offs_e < E)[None, :]
        e_ptrs = n * L * E + t[:, None] * E + offs_e[None, :]
        s_ptrs = state + offs_k[:, None] * E + offs_e[None, :]
        s_mask = (offs_k < M)[:, None] & (offs_e < E)[None, :]
        S = tl.load(CK + s_ptrs, mask=s_mask, other=0.0)
        G = tl.load(DH + M * E + s_ptrs, mask=s_mask, other=0.0)     # slot c + 1 of DH: after the chunk
        dO = tl.load(DO + e_ptrs, mask=e_mask, other=0.0)
        dq = tl.dot(dO, tl.trans(S), acc=dq, input_precision=PREC, out_dtype=acc_t)
        u = tl.load(UN + e_ptrs, mask=e_mask, other=0.0)
        dk = tl.dot(u, tl.trans(G), acc=dk, input_precision=PREC, out_dtype=acc_t)
        dr = tl.load(DR + e_ptrs, mask=e_mask, other=0.0)
        drS = tl.dot(dr, tl.trans(S), acc=drS, input_precision=PREC, out_dtype=acc_t)
    b = tl.load(BETA + n * L + t, mask=mask_t, other=0.0)
    dk -= b[:, None] * drS
    q = tl.load(Q + n * L * M + t[:, None] * M + offs_k[None, :], mask=m_mask, other=0.0)
    k = tl.load(K + n * L * M + t[:, None] * M + offs_k[None, :], mask=m_mask, other=0.0)
    db = -tl.sum(drS * k, axis=1)
    cc = (n * n_chunks + c) * BLOCK_L * BLOCK_L + offs_l[:, None] * BLOCK_L + offs_l[None, :]
    dP = tl.load(DPB + cc)
    dq = tl.dot(dP, k, acc=dq, input_precision=PREC, out_dtype=acc_t)
    dk = tl.dot(tl.trans(dP), q, acc=dk, input_precision=PREC, out_dtype=acc_t)
    Z = tl.load(ZB + cc)
    bZ = b[:, None] * Z
    dk = tl.dot(bZ + tl.trans(bZ), k, acc=dk, input_precision=PREC, out_dtype=acc_t)
    KK = tl.dot(k, tl.trans(k), input_precision=PREC, out_dtype=acc_t)     # this block's share of K K^T
    db += tl.sum(Z * KK, axis=1)
    m_ptrs = n * L * M + t[:, None] * M + offs_k[None, :]
    tl.store(DQ + m_ptrs, dq, mask=m_mask)
    tl.store(DK + m_ptrs, dk, mask=m_mask)
    tl.store(DB + (pid_k * N + n) * L + t, db, mask=mask_t)


# ------------------------------------------------------------------ launch helpers
_HALF = (torch.float16, torch.bfloat16)
#: by operand kind: ``(largest chunk, feature block, value block, warps)`` of the six kernels (blocks shrink to
#: the widths, not below 16; the serial kernels' value block sets their parallelism, N · E / 32 programs). The
#: largest for which ptxas (sm_90, triton 3.9) reported no register spills in any of the six, compiled without a
#: GPU and not timed: 64-position chunks spill on IEEE float32 products (the solve and the C x C gradient sums),
#: so float32 chunks stop at 32; float64 takes float32's (48 bytes of spill in _bwd_chunk_kernel at 32, none at 16:
#: kept at 32 so that the float64 tests run 32-position chunks). ``chunk`` rounds up to a power of two >= 16
#: and down to the largest chunk; the backward reads the chunk from the forward's ``T``.
_TILES = {"half": (64, 32, 32, 8), "tf32": (64, 32, 32, 8), "float32": (32, 32, 32, 8), "float64": (32, 32, 32, 8)}


def _kind(phi_q: Tensor, phi_k: Tensor, v: Tensor, acc: torch.dtype) -> tuple[str, bool]:
    """``(kind, lowp)``: the operand kind of :data:`_TILES` and whether ``q``, ``k``, ``v`` reach the kernels in
    half precision as they are (float16, or bfloat16 on CUDA; the interpreter multiplies bfloat16 wrongly)."""
    lowp = acc == torch.float32 and _lowp(phi_q, phi_k, v)
    half = acc == torch.float32 and any(t.dtype in _HALF for t in (phi_q, phi_k, v))
    return ("half" if lowp else "tf32" if half else str(acc).removeprefix("torch.")), lowp


def _plan(L: int, chunk: int, kind: str) -> tuple[int, int]:
    """``(BLOCK_L, n_chunks)``: chunk rounded up to a power of two >= 16, at most the kind's largest chunk."""
    if chunk < 1:
        raise ValueError(f"triton_delta_rule: chunk: expected an int >= 1, got {chunk}")
    block_l = _block(chunk, _TILES[kind][0])
    return block_l, triton.cdiv(L, block_l)


def _seq(x: Tensor) -> Tensor:
    """``(B, H, ...)`` -> contiguous ``(B*H, ...)``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _forward(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S0: Tensor,
             chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    N = B * H
    acc = _acc_dtype(phi_q, phi_k, v, S0)
    kind, lowp = _kind(phi_q, phi_k, v, acc)
    block_l, nc = _plan(L, chunk, kind)
    _, block_k, block_e, warps = _TILES[kind]
    prec = "tf32" if kind in ("half", "tf32") else "ieee"
    q, k, w, b = (_seq(t) for t in (phi_q, phi_k, v, beta.to(acc)))
    if not lowp:               # one dtype in the kernels (mixed pointer dtypes spilled registers in ptxas)
        q, k, w = (t.to(acc) for t in (q, k, w))
    dev = v.device
    tm = torch.empty(N, nc, block_l, block_l, dtype=acc, device=dev)
    wb = torch.empty(N, L, M, dtype=acc, device=dev)
    ub = torch.empty(N, L, E, dtype=acc, device=dev)
    un = torch.empty(N, L, E, dtype=acc, device=dev)
    ck = torch.empty(N, nc + 1, M, E, dtype=acc, device=dev)    # slot c: the state before chunk c; slot nc: final
    ck[:, 0] = S0.reshape(N, M, E)
    out = torch.empty(N, L, E, dtype=v.dtype, device=dev)
    f64 = acc == torch.float64
    bk, be = _block(M, block_k), _block(E, block_e)
    if N and nc:
        launch(_wy_kernel, lambda m: (N * nc,), (
            k, w, b, tm, wb, ub, L, M, E, nc, k.stride(0), k.stride(1), w.stride(0), w.stride(1)),
            dict(BLOCK_L=block_l, BLOCK_K=bk, BLOCK_E=be, F64=f64, LOWP=lowp, PREC=prec, num_warps=warps))
    if N and nc and E and M:
        launch(_state_kernel, lambda m: (N, triton.cdiv(E, be)), (
            k, wb, ub, ck, un, L, M, E, nc, k.stride(0), k.stride(1)),
            dict(BLOCK_L=block_l, BLOCK_K=bk, BLOCK_E=be, F64=f64, PREC=prec, num_warps=warps))
    elif N and nc:             # no features: the state (empty) stays; u = U
        ck[:, 1:] = ck[:, :1]
        un.copy_(ub)
    if N and nc and E:
        # the linear kernels' output step: o_c = Q_c S_c + tril(Q_c K_c^T) u_c, the states at ck[:, c] (slot c)
        dummy = torch.empty(1, 1, dtype=acc, device=dev)
        consts = dict(BLOCK_L=block_l, WITH_DEN=False, F64=f64, LOWP=lowp, REVERSE=False, INTRA=True,
                      PREC="tf32" if kind == "tf32" else "ieee")
        launch(_chunk_out_kernel, lambda m: (N * nc, triton.cdiv(E, m["BLOCK_W"])), (
            q, k, un, ck, dummy, out, dummy, L, M, E, nc, q.stride(0), q.stride(1), un.stride(0), un.stride(1),
            out.stride(0), out.stride(1), 0, ck.stride(0), ck.stride(1), 0, 0),
            _meta(_LINEAR_TILES[kind][1], M, E, **consts), shrink=("BLOCK_K", "BLOCK_W"))
    return (out.view(B, H, L, E), ck[:, nc].reshape(B, H, M, E).clone(), ck.view(B, H, nc + 1, M, E),
            tm.view(B, H, nc, block_l, block_l), wb.view(B, H, L, M), un.view(B, H, L, E))


def _forward_fake(phi_q, phi_k, v, beta, S0, chunk):
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    acc = _acc_dtype(phi_q, phi_k, v, S0)
    block_l, nc = _plan(L, chunk, _kind(phi_q, phi_k, v, acc)[0])
    return (v.new_empty(B, H, L, E), S0.new_empty(B, H, M, E, dtype=acc),
            v.new_empty(B, H, nc + 1, M, E, dtype=acc), v.new_empty(B, H, nc, block_l, block_l, dtype=acc),
            v.new_empty(B, H, L, M, dtype=acc), v.new_empty(B, H, L, E, dtype=acc))


def _backward_impl(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, ckpt: Tensor, tm: Tensor, wb: Tensor,
                   un: Tensor, dout: Tensor, dS: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    N = B * H
    acc = ckpt.dtype
    nc, block_l = tm.shape[2], tm.shape[-1]          # the forward's chunks
    half = acc == torch.float32 and any(t.dtype in _HALF for t in (phi_q, phi_k, v, dout))
    kind = "tf32" if half else str(acc).removeprefix("torch.")     # every operand widened to acc below
    _, block_k, block_e, warps = _TILES[kind]
    prec = "tf32" if half else "ieee"
    # every operand in the accumulation dtype (the gradients are float32 for half inputs)
    q, k, w, b, ck, T, W, U, do = (_seq(t.to(acc)) for t in (phi_q, phi_k, v, beta, ckpt, tm, wb, un, dout))
    dev = v.device
    dul = torch.empty(N, L, E, dtype=acc, device=dev)
    du = torch.empty(N, L, E, dtype=acc, device=dev)
    dh = torch.empty(N, nc + 1, M, E, dtype=acc, device=dev)  # slot s: the gradient of the state before chunk s
    dh[:, nc] = dS.reshape(N, M, E)
    bk, be = _block(M, block_k), _block(E, block_e)
    nk = triton.cdiv(max(M, 1), bk)
    dq = torch.zeros(N, L, M, dtype=acc, device=dev)
    dk = torch.zeros(N, L, M, dtype=acc, device=dev)
    dv = torch.zeros(N, L, E, dtype=acc, device=dev)
    db = torch.zeros(nk + 1, N, L, dtype=acc, device=dev)      # per feature block; the last: rowsum(dr * V)
    if N and nc and E:
        launch(_bwd_local_kernel, lambda m: (N * nc, triton.cdiv(E, be)), (q, k, do, dul, L, M, E, nc),
               dict(BLOCK_L=block_l, BLOCK_K=bk, BLOCK_E=be, PREC=prec, num_warps=warps))
    if N and nc and E and M:
        launch(_bwd_state_kernel, lambda m: (N, triton.cdiv(E, be)), (q, k, W, do, dul, dh, du, L, M, E, nc),
               dict(BLOCK_L=block_l, BLOCK_K=bk, BLOCK_E=be, PREC=prec, num_warps=warps))
    elif N and nc:
        dh[:, :nc] = dh[:, nc:]
        du.copy_(dul)
    if N and nc:
        dr = torch.zeros(N, L, E, dtype=acc, device=dev)
        dpb = torch.empty(N, nc, block_l, block_l, dtype=acc, device=dev)
        zb = torch.empty(N, nc, block_l, block_l, dtype=acc, device=dev)
        launch(_bwd_intra_kernel, lambda m: (N * nc,), (w, b, T, U, do, du, dr, dpb, zb, dv, db[nk], L, E, nc),
               dict(BLOCK_L=block_l, BLOCK_E=be, PREC=prec, num_warps=warps))
        if M:
            launch(_bwd_chunk_kernel, lambda m: (N * nc, nk), (
                q, k, b, ck, U, do, dh, dr, dpb, zb, dq, dk, db, N, L, M, E, nc),
                dict(BLOCK_L=block_l, BLOCK_K=bk, BLOCK_E=be, PREC=prec, num_warps=warps))
    return (dq.view(B, H, L, M).to(phi_q.dtype), dk.view(B, H, L, M).to(phi_k.dtype),
            dv.view(B, H, L, E).to(v.dtype), db.sum(0).view(B, H, L).to(beta.dtype),
            dh[:, 0].reshape(B, H, M, E).to(dS.dtype, copy=True))


def _backward_fake(phi_q, phi_k, v, beta, ckpt, tm, wb, un, dout, dS, chunk):
    return tuple(torch.empty_like(t) for t in (phi_q, phi_k, v, beta, dS))


#: ``attnkit_kernelized::triton_delta_backward``: gradients of :data:`triton_delta_rule`
triton_delta_backward = define("triton_delta_backward", _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output):
    phi_q, phi_k, v, beta, S0, chunk = inputs
    ctx.save_for_backward(phi_q, phi_k, v, beta, *output[2:])
    ctx.chunk = chunk
    ctx.S0_dtype = S0.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, g_out, g_S, *_g_saved):
    phi_q, phi_k, v, beta, ckpt, tm, wb, un = ctx.saved_tensors
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    g_out = v.new_zeros(B, H, L, E) if g_out is None else g_out.contiguous()
    g_S = ckpt.new_zeros(B, H, M, E) if g_S is None else g_S.contiguous()
    dq, dk, dv, db, dS0 = triton_delta_backward(phi_q, phi_k, v, beta, ckpt, tm, wb, un, g_out, g_S, ctx.chunk)
    return dq, dk, dv, db, dS0.to(ctx.S0_dtype), None


#: ``attnkit_kernelized::triton_delta_rule``: ``(phi_q, phi_k, v, beta, S0, chunk) -> (out, S, saved...)``; the
#: saved tensors (chunk states, ``T``, ``W``, ``u``) are float32 for half inputs, as is the state; differentiable
#: in the first five inputs
triton_delta_rule = define("triton_delta_rule", _forward, _forward_fake, backward=_backward,
                           setup_context=_setup_context)


def delta_rule(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S0: Tensor | None = None, *,
               chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """The delta rule with the triton kernels (the ``triton`` backend of ``fast-weight``; differentiable).

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``; beta: ``(B, H, L)``; CUDA tensors (or CPU tensors
            under ``TRITON_INTERPRET=1``), float16/bfloat16/float32/float64.
        S0: the state ``(B, H, M, E)`` carried in (None: zeros).
        chunk: positions per chunk, rounded up to a power of two >= 16 and down to at most 64 (half inputs) or
            32 (float32, float64; :data:`_TILES`). The result does not depend on it beyond rounding.

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E))``: ``out`` in the dtype of ``v``; the state accumulated and returned
        in float32 for half-precision inputs (float64 for float64).
    """
    B, H, L, M = phi_q.shape
    acc = _acc_dtype(phi_q, v)
    S0 = phi_q.new_zeros(B, H, M, v.shape[-1], dtype=acc) if S0 is None else S0.to(acc)
    out, S = triton_delta_rule(phi_q, phi_k, v, beta, S0, chunk)[:2]
    return out, S
