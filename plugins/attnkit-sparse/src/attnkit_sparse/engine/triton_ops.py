"""The ``triton`` backend: block-sparse forward and backward kernels executing the plan (CUDA).

* ``_forward_kernel``: one program per (query block, batch x head) walks the
  key blocks of the plan's ``kv_idx`` with an online softmax (``tl.dot`` per
  tile, the PARTIAL tile's element mask loaded from the bank), stores ``out``
  and the log-sum-exp.
* ``_backward_dq_kernel``: one program per (query block, batch x head):
  ``P = exp(scale·QKᵀ − lse)``, ``dS = P (dO Vᵀ − Δ)``, ``dQ += scale · dS K``.
* ``_backward_dkdv_kernel``: one program per (key block, batch x head) over
  the transposed index: ``dV += Pᵀ dO``, ``dK += scale · dSᵀ Q``; no atomics.

Accumulation is float32 (float64 for float64 inputs); float32 and float64 inputs
get IEEE products, float16 and bfloat16 inputs go to ``tl.dot`` as they are
(tensor cores, float32 results; the softmax weights and ``dS`` are rounded to
the input dtype for their products, as flash attention does). The
log-sum-exp and ``Δ = rowsum(dO ∘ O)`` are float32 for half inputs.
Block sizes must be powers of two >= 16 (``tl.dot``). The module imports
triton at import time and is imported only when the backend runs; CPU
tensors run under ``TRITON_INTERPRET=1`` (set before the run), which is how
the tests exercise it. Operator: ``attnkit_sparse::triton_block_attention``
(differentiable through ``register_autograd``, with a fake implementation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnkit.errors import InvalidInputError
from attnkit.first_order import first_order

from .plan import BlockPlan, tl_dot_blocks

NAMESPACE = "attnkit_sparse"


@triton.jit
def _mm(a, b, acc_t: tl.constexpr, LOWP: tl.constexpr):
    """``a @ b``: half-precision operands on the tensor cores with a float32 result (``LOWP``), else IEEE
    products in ``acc_t`` (float32 or float64)."""
    if LOWP:
        out = tl.dot(a, b, out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, input_precision="ieee", out_dtype=acc_t)
    return out


@triton.jit
def _forward_kernel(Q, K, V, OUT, LSE, KV_COUNT, KV_IDX, KV_TILE, BANK, L, S, H, Bp, Hp, NQ, CK, D, E, scale,
                    BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, F64: tl.constexpr,
                    LOWP: tl.constexpr):
    qb = tl.program_id(0)
    n = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    op_t = Q.dtype.element_ty if LOWP else acc_t  # the operands of the products
    row = ((n // H) % Bp * Hp + (n % H) % Hp) * NQ + qb
    offs_q = qb * BQ + tl.arange(0, BQ)
    offs_d = tl.arange(0, BD)
    offs_e = tl.arange(0, BE)
    offs_j = tl.arange(0, BK)
    q_in = offs_q < L
    q = tl.load(Q + n * L * D + offs_q[:, None] * D + offs_d[None, :],
                mask=q_in[:, None] & (offs_d < D)[None, :], other=0.0).to(op_t)
    m = tl.full([BQ], float("-inf"), acc_t)
    lsum = tl.zeros([BQ], acc_t)
    acc = tl.zeros([BQ, BE], acc_t)
    count = tl.load(KV_COUNT + row)
    for c in range(0, count):
        kb = tl.load(KV_IDX + row * CK + c)
        t = tl.load(KV_TILE + row * CK + c)
        offs_k = kb * BK + offs_j
        k_in = offs_k < S
        k = tl.load(K + n * S * D + offs_k[:, None] * D + offs_d[None, :],
                    mask=k_in[:, None] & (offs_d < D)[None, :], other=0.0).to(op_t)
        v = tl.load(V + n * S * E + offs_k[:, None] * E + offs_e[None, :],
                    mask=k_in[:, None] & (offs_e < E)[None, :], other=0.0).to(op_t)
        s = _mm(q, tl.trans(k), acc_t, LOWP) * scale
        tile = tl.load(BANK + tl.maximum(t, 0) * BQ * BK + tl.arange(0, BQ)[:, None] * BK + offs_j[None, :],
                       mask=(offs_j[None, :] * 0 + t >= 0) & q_in[:, None] & k_in[None, :], other=1)
        keep = k_in[None, :] & q_in[:, None] & (tile != 0)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mm(p.to(op_t), v, acc_t, LOWP)
        m = m_new
    has = lsum > 0
    out = acc / tl.where(has, lsum, 1.0)[:, None]
    tl.store(OUT + n * L * E + offs_q[:, None] * E + offs_e[None, :], out, mask=q_in[:, None] & (offs_e < E)[None, :])
    lse = tl.where(has, m + tl.log(tl.where(has, lsum, 1.0)), float("inf"))
    tl.store(LSE + n * L + offs_q, lse, mask=q_in)


@triton.jit
def _backward_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, KV_COUNT, KV_IDX, KV_TILE, BANK, L, S, H, Bp, Hp, NQ, CK, D, E,
                        scale, BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                        F64: tl.constexpr, LOWP: tl.constexpr):
    qb = tl.program_id(0)
    n = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    op_t = Q.dtype.element_ty if LOWP else acc_t  # the operands of the products
    row = ((n // H) % Bp * Hp + (n % H) % Hp) * NQ + qb
    offs_q = qb * BQ + tl.arange(0, BQ)
    offs_d = tl.arange(0, BD)
    offs_e = tl.arange(0, BE)
    offs_j = tl.arange(0, BK)
    q_in = offs_q < L
    q = tl.load(Q + n * L * D + offs_q[:, None] * D + offs_d[None, :],
                mask=q_in[:, None] & (offs_d < D)[None, :], other=0.0).to(op_t)
    do = tl.load(DO + n * L * E + offs_q[:, None] * E + offs_e[None, :],
                 mask=q_in[:, None] & (offs_e < E)[None, :], other=0.0).to(op_t)
    lse = tl.load(LSE + n * L + offs_q, mask=q_in, other=float("inf")).to(acc_t)
    delta = tl.load(DELTA + n * L + offs_q, mask=q_in, other=0.0).to(acc_t)
    dq = tl.zeros([BQ, BD], acc_t)
    count = tl.load(KV_COUNT + row)
    for c in range(0, count):
        kb = tl.load(KV_IDX + row * CK + c)
        t = tl.load(KV_TILE + row * CK + c)
        offs_k = kb * BK + offs_j
        k_in = offs_k < S
        k = tl.load(K + n * S * D + offs_k[:, None] * D + offs_d[None, :],
                    mask=k_in[:, None] & (offs_d < D)[None, :], other=0.0).to(op_t)
        v = tl.load(V + n * S * E + offs_k[:, None] * E + offs_e[None, :],
                    mask=k_in[:, None] & (offs_e < E)[None, :], other=0.0).to(op_t)
        s = _mm(q, tl.trans(k), acc_t, LOWP) * scale
        tile = tl.load(BANK + tl.maximum(t, 0) * BQ * BK + tl.arange(0, BQ)[:, None] * BK + offs_j[None, :],
                       mask=(offs_j[None, :] * 0 + t >= 0) & q_in[:, None] & k_in[None, :], other=1)
        keep = k_in[None, :] & q_in[:, None] & (tile != 0)
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), acc_t, LOWP)
        ds = p * (dp - delta[:, None]) * scale
        dq += _mm(ds.to(op_t), k, acc_t, LOWP)
    tl.store(DQ + n * L * D + offs_q[:, None] * D + offs_d[None, :], dq, mask=q_in[:, None] & (offs_d < D)[None, :])


@triton.jit
def _backward_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, Q_COUNT, Q_IDX, Q_TILE, BANK, L, S, H, Bp, Hp, NK, CQ, D,
                          E, scale, BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr,
                          F64: tl.constexpr, LOWP: tl.constexpr):
    kb = tl.program_id(0)
    n = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    op_t = Q.dtype.element_ty if LOWP else acc_t  # the operands of the products
    row = ((n // H) % Bp * Hp + (n % H) % Hp) * NK + kb
    offs_k = kb * BK + tl.arange(0, BK)
    offs_d = tl.arange(0, BD)
    offs_e = tl.arange(0, BE)
    offs_i = tl.arange(0, BQ)
    k_in = offs_k < S
    k = tl.load(K + n * S * D + offs_k[:, None] * D + offs_d[None, :],
                mask=k_in[:, None] & (offs_d < D)[None, :], other=0.0).to(op_t)
    v = tl.load(V + n * S * E + offs_k[:, None] * E + offs_e[None, :],
                mask=k_in[:, None] & (offs_e < E)[None, :], other=0.0).to(op_t)
    dk = tl.zeros([BK, BD], acc_t)
    dv = tl.zeros([BK, BE], acc_t)
    count = tl.load(Q_COUNT + row)
    for c in range(0, count):
        qb = tl.load(Q_IDX + row * CQ + c)
        t = tl.load(Q_TILE + row * CQ + c)
        offs_q = qb * BQ + offs_i
        q_in = offs_q < L
        q = tl.load(Q + n * L * D + offs_q[:, None] * D + offs_d[None, :],
                    mask=q_in[:, None] & (offs_d < D)[None, :], other=0.0).to(op_t)
        do = tl.load(DO + n * L * E + offs_q[:, None] * E + offs_e[None, :],
                     mask=q_in[:, None] & (offs_e < E)[None, :], other=0.0).to(op_t)
        lse = tl.load(LSE + n * L + offs_q, mask=q_in, other=float("inf")).to(acc_t)
        delta = tl.load(DELTA + n * L + offs_q, mask=q_in, other=0.0).to(acc_t)
        sT = _mm(k, tl.trans(q), acc_t, LOWP) * scale      # (BK, BQ)
        tile = tl.load(BANK + tl.maximum(t, 0) * BQ * BK + offs_i[None, :] * BK + tl.arange(0, BK)[:, None],
                       mask=(offs_i[None, :] * 0 + t >= 0) & k_in[:, None] & q_in[None, :], other=1)
        keep = k_in[:, None] & q_in[None, :] & (tile != 0)
        pT = tl.where(keep, tl.exp(sT - lse[None, :]), 0.0)
        dv += _mm(pT.to(op_t), do, acc_t, LOWP)
        dpT = _mm(v, tl.trans(do), acc_t, LOWP)
        dsT = pT * (dpT - delta[None, :]) * scale
        dk += _mm(dsT.to(op_t), q, acc_t, LOWP)
    tl.store(DK + n * S * D + offs_k[:, None] * D + offs_d[None, :], dk, mask=k_in[:, None] & (offs_d < D)[None, :])
    tl.store(DV + n * S * E + offs_k[:, None] * E + offs_e[None, :], dv, mask=k_in[:, None] & (offs_e < E)[None, :])


def _acc(q: Tensor) -> torch.dtype:
    """The dtype of the log-sum-exp, Δ and the accumulators: float64 for float64 inputs, else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _lowp(q: Tensor) -> bool:
    """Half-precision operands go to ``tl.dot`` as they are (tensor cores, float32 results). bfloat16 only on
    CUDA: the triton interpreter multiplies bfloat16 operands wrongly, so there they are widened to float32."""
    return q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and q.device.type == "cuda")


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _bank8(bank: Tensor) -> Tensor:
    """The bank as int8 (at least one entry, so the kernels always get a valid pointer); a bank that is already
    that (:meth:`BlockPlan.int8_bank`, what :func:`attend` passes) is used as it is, with no copy."""
    if bank.dtype == torch.int8 and bank.shape[0] > 0 and bank.is_contiguous():
        return bank
    if bank.shape[0] == 0:
        bank = torch.ones(1, *bank.shape[1:], dtype=torch.bool, device=bank.device)
    return bank.to(torch.int8).contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, kv_count: Tensor, kv_idx: Tensor, kv_tile: Tensor, q_count: Tensor,
             q_idx: Tensor, q_tile: Tensor, bank: Tensor, bq: int, bk: int, scale: float) -> tuple[Tensor, Tensor]:
    B, H, L, D = q.shape
    S, E = k.shape[-2], v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = q.new_empty(B, H, L, E)
    lse = q.new_empty(B, H, L, dtype=_acc(q))
    Bp, Hp, NQ = kv_count.shape
    grid = (NQ, B * H)
    _forward_kernel[grid](q, k, v, out, lse, kv_count.contiguous(), kv_idx.contiguous(), kv_tile.contiguous(),
                          _bank8(bank), L, S, H, Bp, Hp, NQ, kv_idx.shape[-1], D, E, scale,
                          BQ=bq, BK=bk, BD=_p2(D), BE=_p2(E), F64=q.dtype == torch.float64, LOWP=_lowp(q))
    return out, lse


def _forward_fake(q, k, v, kv_count, kv_idx, kv_tile, q_count, q_idx, q_tile, bank, bq, bk, scale):
    B, H, L, _ = q.shape
    return q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, L, dtype=_acc(q))


def _backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, g: Tensor, g_lse: Tensor | None,
              kv_count: Tensor, kv_idx: Tensor, kv_tile: Tensor, q_count: Tensor, q_idx: Tensor, q_tile: Tensor,
              bank: Tensor, bq: int, bk: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    B, H, L, D = q.shape
    S, E = k.shape[-2], v.shape[-1]
    q, k, v, g = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous()
    # dS = P ∘ (dP − Δ) with Δ = rowsum(dO ∘ O) − d lse (∂lse/∂s = P); rows without a key (lse = +inf) have P = 0
    # (g_lse None: the log-sum-exp was not used, Δ = rowsum(dO ∘ O); four fewer small kernels per call)
    acc = _acc(q)
    delta = (g.to(acc) * out.to(acc)).sum(-1)
    if g_lse is not None:
        delta = delta - torch.where(torch.isfinite(lse), g_lse.to(acc), torch.zeros((), dtype=acc, device=lse.device))
    delta = delta.contiguous()
    bank8 = _bank8(bank)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    Bp, Hp, NQ = kv_count.shape
    NK = q_count.shape[-1]
    consts = dict(BQ=bq, BK=bk, BD=_p2(D), BE=_p2(E), F64=q.dtype == torch.float64, LOWP=_lowp(q))
    _backward_dq_kernel[(NQ, B * H)](q, k, v, g, lse.contiguous(), delta, dq, kv_count.contiguous(),
                                     kv_idx.contiguous(), kv_tile.contiguous(), bank8, L, S, H, Bp, Hp, NQ,
                                     kv_idx.shape[-1], D, E, scale, **consts)
    _backward_dkdv_kernel[(NK, B * H)](q, k, v, g, lse.contiguous(), delta, dk, dv, q_count.contiguous(),
                                       q_idx.contiguous(), q_tile.contiguous(), bank8, L, S, H, Bp, Hp, NK,
                                       q_idx.shape[-1], D, E, scale, **consts)
    return dq, dk, dv


def _backward_fake(q, k, v, out, lse, g, g_lse, kv_count, kv_idx, kv_tile, q_count, q_idx, q_tile, bank, bq, bk,
                   scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


triton_block_attention_backward = torch.library.custom_op(
    f"{NAMESPACE}::triton_block_attention_backward", mutates_args=())(_backward)
triton_block_attention_backward.register_fake(_backward_fake)

triton_block_attention = torch.library.custom_op(f"{NAMESPACE}::triton_block_attention", mutates_args=())(_forward)
triton_block_attention.register_fake(_forward_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, *index, bq, bk, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], *index)
    ctx.bq, ctx.bk, ctx.scale = bq, bk, scale


def _autograd(ctx, g_out, g_lse):
    q, k, v, out, lse, *index = ctx.saved_tensors
    if g_out is None:
        g_out = torch.zeros_like(out)
    dq, dk, dv = triton_block_attention_backward(q, k, v, out, lse, g_out, g_lse, *index, ctx.bq, ctx.bk,
                                                 ctx.scale)
    return dq, dk, dv, *([None] * 10)


triton_block_attention.register_autograd(first_order(_autograd), setup_context=_setup_context)


def attend(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float,
           return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse attention with the triton kernels (differentiable in q, k, v).

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``; CUDA tensors (CPU under TRITON_INTERPRET=1).
        plan: the :class:`~attnkit_sparse.engine.plan.BlockPlan`; block sizes powers of two >= 16.
        scale: multiplier of ``q · k``.
        return_lse: also return the log-sum-exp ``(B, H, L)`` of the scaled scores per row (``+inf`` for a
            row with no key; float32 for half inputs), differentiable like the output.

    Returns:
        ``(B, H, L, E)``; rows with no allowed key are 0. Or ``(out, lse)``.

    Raises:
        InvalidInputError: a block size that is not a power of two >= 16.
    """
    bq, bk = plan.block_size
    if not tl_dot_blocks(plan.block_size):
        name, n = ("query", bq) if not tl_dot_blocks((bq, bq)) else ("key", bk)
        raise InvalidInputError(f"block_size ({name}): the triton backend takes powers of two >= 16, got {n}")
    out, lse = triton_block_attention(q, k, v, plan.kv_count, plan.kv_idx, plan.kv_tile, plan.q_count, plan.q_idx,
                                      plan.q_tile, plan.int8_bank(), bq, bk, float(scale))
    return (out, lse) if return_lse else out
