"""triton kernels (CUDA) of linear attention (``linear``, ``performer``) and their operators.

The same product primitive as :mod:`.numba_ops`::

    out[t] = x[t]^T (S0 + sum_{j in J(t)} y[j] w[j]^T)     den[t] = x[t] . (z0 + sum_{j in J(t)} y[j])

``_causal_product_kernel`` (``J(t)``: ``j <= t``, or ``j >= t`` when
``REVERSE``): one program per (sequence, block of E columns of ``w``) walks
the sequence in chunks of ``BLOCK_L`` positions, holding the running state
``S`` (``BLOCK_M x BLOCK_E``) in registers: per chunk one masked ``x y^T``
block (``tl.dot``), ``A w + x S``, then ``S += y^T w``.
``_full_product_kernel`` (every j, L != S allowed) first accumulates ``S``
over every key, then computes ``x S``. Both start from a state and store the
final one. Accumulation is float32 (float64 for float64 inputs), and so are
the outputs and final states (half-precision inputs: float32 numerators,
denominators and states, so long sums cannot overflow float16), with IEEE
(not TF32) products so results agree with the torch path in float32. The
backward pass is three more products
(:func:`attnkit_kernelized._ops.linear_attention_backward`).

This module imports triton at import time; it is imported only when the
``triton`` backend runs. On CPU tensors it runs under ``TRITON_INTERPRET=1``
(set before the first import: triton reads it when the kernels are defined);
timings need a CUDA device.

Operators (``torch.library``, namespace ``attnkit_kernelized``):
``triton_linear_product`` (the primitive) and ``triton_linear_attention``
(differentiable, normalised).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._ops import acc_dtype as _acc_dtype
from .._ops import call_linear_attention, define, define_linear_attention
from .._triton_fit import launch, wide_feature_tiles
from ..common import DEFAULT_CHUNK
from ..common import normalize as _normalize


@triton.jit
def _causal_product_kernel(X, Y, W, S0, Z0, OUT, DEN, SF, ZF, L, DX, DW,
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
    s_ptrs = n * DX * DW + offs_x[:, None] * DW + offs_w[None, :]
    s_mask = mask_x[:, None] & mask_w[None, :]
    S = tl.load(S0 + s_ptrs, mask=s_mask, other=0.0).to(acc_t)
    z = tl.load(Z0 + n * DX + offs_x, mask=mask_x, other=0.0).to(acc_t)
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
    tl.store(SF + s_ptrs, S.to(SF.dtype.element_ty), mask=s_mask)
    if pid_w == 0:
        tl.store(ZF + n * DX + offs_x, z.to(ZF.dtype.element_ty), mask=mask_x)


@triton.jit
def _full_product_kernel(X, Y, W, S0, Z0, OUT, DEN, SF, ZF, L, S_LEN, DX, DW,
                         stride_xn, stride_xl, stride_yn, stride_yl, stride_wn, stride_wl, stride_on, stride_ol,
                         stride_dn, BLOCK_L: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_W: tl.constexpr,
                         WITH_DEN: tl.constexpr, F64: tl.constexpr):
    n = tl.program_id(0)
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
    z = tl.load(Z0 + n * DX + offs_x, mask=mask_x, other=0.0).to(acc_t)
    for c in range(0, tl.cdiv(S_LEN, BLOCK_L)):     # the state over every key
        j = c * BLOCK_L + offs_l
        mask_j = j < S_LEN
        y = tl.load(Y + n * stride_yn + j[:, None] * stride_yl + offs_x[None, :],
                    mask=mask_j[:, None] & mask_x[None, :], other=0.0).to(acc_t)
        w = tl.load(W + n * stride_wn + j[:, None] * stride_wl + offs_w[None, :],
                    mask=mask_j[:, None] & mask_w[None, :], other=0.0).to(acc_t)
        S += tl.dot(tl.trans(y), w, input_precision="ieee", out_dtype=acc_t)
        if WITH_DEN:
            z += tl.sum(y, axis=0)
    for c in range(0, tl.cdiv(L, BLOCK_L)):         # every query reads it
        t = c * BLOCK_L + offs_l
        mask_t = t < L
        x = tl.load(X + n * stride_xn + t[:, None] * stride_xl + offs_x[None, :],
                    mask=mask_t[:, None] & mask_x[None, :], other=0.0).to(acc_t)
        o = tl.dot(x, S, input_precision="ieee", out_dtype=acc_t)
        tl.store(OUT + n * stride_on + t[:, None] * stride_ol + offs_w[None, :], o.to(OUT.dtype.element_ty),
                 mask=mask_t[:, None] & mask_w[None, :])
        if WITH_DEN:
            if pid_w == 0:
                den = tl.sum(x * z[None, :], axis=1)
                tl.store(DEN + n * stride_dn + t, den.to(DEN.dtype.element_ty), mask=mask_t)
    tl.store(SF + s_ptrs, S.to(SF.dtype.element_ty), mask=s_mask)
    if pid_w == 0:
        tl.store(ZF + n * DX + offs_x, z.to(ZF.dtype.element_ty), mask=mask_x)


def _block(n: int, cap: int | None = None) -> int:
    b = max(16, triton.next_power_of_2(max(n, 1)))
    return min(b, cap) if cap else b


_MODES = ("causal", "reverse", "full")


def _product(x: Tensor, y: Tensor, w: Tensor, S0: Tensor, z0: Tensor, mode: str, chunk: int, with_den: bool,
             normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The product primitive (see :mod:`.numba_ops`) with the triton kernels; ``chunk`` rounds up to a power
    of two >= 16 (positions per block)."""
    N, L, DX = x.shape
    S, DW = y.shape[1], w.shape[2]
    if mode not in _MODES or (mode != "full" and L != S) or chunk < 1 or (normalize and not with_den):
        raise ValueError(f"triton_linear_product: mode must be one of {_MODES} (L == S unless 'full'), chunk >= 1, "
                         f"normalize only with with_den; got mode={mode!r}, L={L}, S={S}, chunk={chunk}")
    x, y, w = x.contiguous(), y.contiguous(), w.contiguous()
    S0, z0 = S0.contiguous(), z0.contiguous()
    acc = _acc_dtype(x, y, w, S0, z0)   # half-precision inputs: float32 outputs and states (no float16 overflow)
    out = torch.empty(N, L, DW, dtype=acc, device=x.device)
    den = torch.empty(N, L if with_den else 0, dtype=acc, device=x.device)
    den_arg = den if with_den else torch.empty(N, 1, dtype=acc, device=x.device)
    SF = torch.empty(S0.shape, dtype=acc, device=x.device)
    zF = torch.empty(z0.shape, dtype=acc, device=x.device)
    BLOCK_X, BLOCK_W = _block(DX), _block(DW, 64)
    meta = dict(BLOCK_L=_block(chunk), BLOCK_X=BLOCK_X, BLOCK_W=BLOCK_W, WITH_DEN=with_den,
                F64=acc == torch.float64, num_warps=8 if BLOCK_X >= 256 else 4)
    meta.update(wide_feature_tiles(BLOCK_X, meta["BLOCK_L"]))

    def grid(m):
        return (N, triton.cdiv(max(DW, 1), m["BLOCK_W"]))
    if N:  # positions per block and value columns per program may shrink to fit shared memory
        if mode == "full":
            launch(_full_product_kernel, grid, (
                x, y, w, S0, z0, out, den_arg, SF, zF, L, S, DX, DW, x.stride(0), x.stride(1), y.stride(0),
                y.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), den_arg.stride(0)), meta,
                shrink=("BLOCK_L", "BLOCK_W"))
        else:
            launch(_causal_product_kernel, grid, (
                x, y, w, S0, z0, out, den_arg, SF, zF, L, DX, DW, x.stride(0), x.stride(1), w.stride(0),
                w.stride(1), out.stride(0), out.stride(1), den_arg.stride(0)), {**meta, "REVERSE": mode == "reverse"},
                shrink=("BLOCK_L", "BLOCK_W"))
    if normalize:
        out = _normalize(out, den)
    return out, den, SF, zF


def _product_fake(x, y, w, S0, z0, mode, chunk, with_den, normalize):
    N, L, _ = x.shape
    acc = _acc_dtype(x, y, w, S0, z0)
    return (x.new_empty(N, L, w.shape[-1], dtype=acc), x.new_empty(N, L if with_den else 0, dtype=acc),
            S0.new_empty(S0.shape, dtype=acc), z0.new_empty(z0.shape, dtype=acc))


#: ``attnkit_kernelized::triton_linear_product`` (see :func:`attnkit_kernelized._ops.define_linear_attention`)
triton_linear_product = define("triton_linear_product", _product, _product_fake)

#: ``attnkit_kernelized::triton_linear_attention``: normalised, differentiable, with state in and out
triton_linear_attention = define_linear_attention("triton", triton_linear_product)


def linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor | None = None, z0: Tensor | None = None,
                     *, causal: bool, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised linear attention with the triton kernels (the ``triton`` backend; differentiable).

    Args:
        phi_q: ``(B, H, L, M)``; phi_k: ``(B, H, S, M)``; v: ``(B, H, S, E)``; CUDA tensors (or CPU
            tensors under ``TRITON_INTERPRET=1``).
        S0, z0: the state ``(B, H, M, E)``, ``(B, H, M)`` carried in (None: zeros).
        causal: prefix sums (L == S) or every key (any S).
        chunk: positions per block (rounded up to a power of two >= 16).

    Returns:
        ``(out (B, H, L, E), S (B, H, M, E), z (B, H, M))``.
    """
    return call_linear_attention(triton_linear_attention, phi_q, phi_k, v, S0, z0, causal=causal, chunk=chunk)
