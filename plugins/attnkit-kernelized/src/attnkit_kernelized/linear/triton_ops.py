"""triton kernels (CUDA) of linear attention (``linear``, ``performer``) and their operators.

The same product primitive as :mod:`.numba_ops`::

    out[t] = x[t]^T (S0 + sum_{j in J(t)} y[j] w[j]^T)     den[t] = x[t] . (z0 + sum_{j in J(t)} y[j])

computed in the chunk-parallel form (as flash-linear-attention's ``chunk``
kernels): the sequence is cut into chunks of ``BLOCK_L`` positions and

1. ``_chunk_state_kernel``, one program per (sequence and chunk, block of x's
   features, block of w's columns): the chunk's own state ``dS_c = Y_c^T W_c``
   (and ``dz_c = sum Y_c`` with the denominator) into a float32 (float64)
   buffer ``(N, C + 1, DX, DW)`` that holds ``S0`` at slot 0 and chunk c at
   slot ``c + 1`` (``C - c`` in reverse mode, so one forward prefix serves both
   directions);
2. the prefix over the slots, ``torch.cumsum`` in place: slot s then holds
   ``S0`` plus the chunks at slots before s, the state before the chunk at
   slot ``s + 1``, and slot C the final state; in ``full`` mode the sum over
   the slots is the state every query reads;
3. ``_chunk_out_kernel``, one program per (sequence and chunk, block of w's
   columns): ``o_c = mask(X_c Y_c^T) W_c + X_c S_before(c)`` and the
   denominator, the features in blocks of ``BLOCK_K`` (in ``full`` mode only
   ``X_c S`` with the state over every key; ``L != S`` allowed).

Every program is independent, so a sequence's chunks run in parallel (the
earlier form walked each sequence serially in one program per sequence).
Tiles are at most 64 x 64.

Precision: float16 inputs (bfloat16 on CUDA) go to ``tl.dot`` as they are
(tensor cores, float32 accumulation) for ``X Y^T`` and ``Y^T W``; the two
products with a computed float32 factor (``A W`` with the masked ``A``, and
``X S`` with the carried state) run as tensor-core products of float32
operands (the half-precision operand widened exactly), so neither ``A`` nor
the state is ever rounded to float16 (whose range the state overflows on
long sums). Mixed dtypes are widened to a common one before the kernels:
when a half-precision operand meets a float32 one (the backward pass of
half-precision inputs, whose gradients are float32) every product is a
tensor-core product of float32 operands; bfloat16 on CPU (the triton
interpreter multiplies bfloat16 operands wrongly) widens the same way. Those
float32 products are 3xTF32 when an operand is float16 and TF32 for bfloat16
(:func:`_precision`): TF32 keeps only float16's 10-bit mantissa, and ``dq``'s
cancellation (the normaliser's two terms) amplified that rounding to 6.6e-3
of the largest gradient on an H100, against 4.1e-4 with 3xTF32, at +13% of a
float16 forward+backward at 64K (docs/benchmarks.md, "GPU run 5"). float32 inputs use IEEE (not TF32)
products so results agree with the torch path at float32 tolerances; float64
stays float64 (IEEE). Outputs, denominators and states
are float32 for half-precision inputs (float64 for float64). The backward
pass is three more products
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
from .._triton_fit import MIN_TILE, _is_out_of_resources, launch
from .._triton_fit import block as _block
from ..common import DEFAULT_CHUNK
from ..common import normalize as _normalize


@triton.jit
def _chunk_state_kernel(Y, W, DS, DZ, S_LEN, DX, DW, n_chunks,
                        stride_yn, stride_yl, stride_wn, stride_wl, stride_sn, stride_sc, stride_zn, stride_zc,
                        BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                        REVERSE: tl.constexpr, WITH_DEN: tl.constexpr, F64: tl.constexpr, LOWP: tl.constexpr,
                        PREC: tl.constexpr):
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)     # n * stride may pass 2**31 on long batches
    c = pid % n_chunks
    pid_k = tl.program_id(1)
    pid_w = tl.program_id(2)
    acc_t = tl.float64 if F64 else tl.float32
    if REVERSE:
        slot = n_chunks - 1 - c
    else:
        slot = c
    t = c * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_t = t < S_LEN
    mask_k = offs_k < DX
    mask_w = offs_w < DW
    y = tl.load(Y + n * stride_yn + t[:, None] * stride_yl + offs_k[None, :],
                mask=mask_t[:, None] & mask_k[None, :], other=0.0)
    w = tl.load(W + n * stride_wn + t[:, None] * stride_wl + offs_w[None, :],
                mask=mask_t[:, None] & mask_w[None, :], other=0.0)
    if LOWP:    # half-precision operands as they are: tensor cores, float32 sums
        ds = tl.dot(tl.trans(y), w, out_dtype=tl.float32)
    else:
        y = y.to(acc_t)
        ds = tl.dot(tl.trans(y), w.to(acc_t), input_precision=PREC, out_dtype=acc_t)
    tl.store(DS + n * stride_sn + (slot + 1) * stride_sc + offs_k[:, None] * DW + offs_w[None, :],
             ds.to(DS.dtype.element_ty), mask=mask_k[:, None] & mask_w[None, :])
    if WITH_DEN:
        if pid_w == 0:
            dz = tl.sum(y.to(acc_t), axis=0)
            tl.store(DZ + n * stride_zn + (slot + 1) * stride_zc + offs_k, dz.to(DZ.dtype.element_ty), mask=mask_k)


@triton.jit
def _chunk_out_kernel(X, Y, W, ST, ZT, OUT, DEN, L, DX, DW, n_chunks,
                      stride_xn, stride_xl, stride_wn, stride_wl, stride_on, stride_ol, stride_dn,
                      stride_sn, stride_sc, stride_zn, stride_zc,
                      BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                      REVERSE: tl.constexpr, INTRA: tl.constexpr, WITH_DEN: tl.constexpr, F64: tl.constexpr,
                      LOWP: tl.constexpr, PREC: tl.constexpr):
    # INTRA (causal, reverse): X S_before + mask(X Y^T) W with S_before at ST[n, slot] (the prefix);
    # not INTRA (full): X S with the state over every key (stride_sc = stride_zc = 0)
    pid = tl.program_id(0)
    n = (pid // n_chunks).to(tl.int64)     # n * stride may pass 2**31 on long batches
    c = pid % n_chunks
    pid_w = tl.program_id(1)
    acc_t = tl.float64 if F64 else tl.float32
    if REVERSE:
        slot = n_chunks - 1 - c
    else:
        slot = c
    offs_l = tl.arange(0, BLOCK_L)
    t = c * BLOCK_L + offs_l
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    mask_t = t < L
    mask_w = offs_w < DW
    o = tl.zeros((BLOCK_L, BLOCK_W), dtype=acc_t)
    A = tl.zeros((BLOCK_L, BLOCK_L), dtype=acc_t)
    d = tl.zeros((BLOCK_L,), dtype=acc_t)
    for kb in range(0, tl.cdiv(DX, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < DX
        xy_mask = mask_t[:, None] & mask_k[None, :]
        x = tl.load(X + n * stride_xn + t[:, None] * stride_xl + offs_k[None, :], mask=xy_mask, other=0.0)
        s_off = offs_k[:, None] * DW + offs_w[None, :]
        s_mask = mask_k[:, None] & mask_w[None, :]
        s = tl.load(ST + n * stride_sn + slot * stride_sc + s_off, mask=s_mask, other=0.0)
        if INTRA:
            y = tl.load(Y + n * stride_xn + t[:, None] * stride_xl + offs_k[None, :], mask=xy_mask, other=0.0)
            if LOWP:
                A = tl.dot(x, tl.trans(y), acc=A, out_dtype=tl.float32)
            else:
                A = tl.dot(x.to(acc_t), tl.trans(y.to(acc_t)), acc=A, input_precision=PREC, out_dtype=acc_t)
        if LOWP:    # the float32 state stays float32: (3x)TF32 tensor cores (x widens exactly)
            o = tl.dot(x.to(tl.float32), s, acc=o, input_precision=PREC, out_dtype=tl.float32)
        else:
            o = tl.dot(x.to(acc_t), s, acc=o, input_precision=PREC, out_dtype=acc_t)
        if WITH_DEN:
            if pid_w == 0:
                z = tl.load(ZT + n * stride_zn + slot * stride_zc + offs_k, mask=mask_k, other=0.0)
                d += tl.sum(x.to(acc_t) * z[None, :], axis=1)
    if INTRA:
        if REVERSE:
            keep = offs_l[:, None] <= offs_l[None, :]
        else:
            keep = offs_l[:, None] >= offs_l[None, :]
        A = tl.where(keep, A, 0.0)
        w = tl.load(W + n * stride_wn + t[:, None] * stride_wl + offs_w[None, :],
                    mask=mask_t[:, None] & mask_w[None, :], other=0.0)
        if LOWP:    # A stays float32 (never rounded to float16): (3x)TF32 tensor cores (w widens exactly)
            o = tl.dot(A, w.to(tl.float32), acc=o, input_precision=PREC, out_dtype=tl.float32)
        else:
            o = tl.dot(A, w.to(acc_t), acc=o, input_precision=PREC, out_dtype=acc_t)
        if WITH_DEN:
            d += tl.sum(A, axis=1)
    tl.store(OUT + n * stride_on + t[:, None] * stride_ol + offs_w[None, :], o.to(OUT.dtype.element_ty),
             mask=mask_t[:, None] & mask_w[None, :])
    if WITH_DEN:
        if pid_w == 0:
            tl.store(DEN + n * stride_dn + t, d.to(DEN.dtype.element_ty), mask=mask_t)


_HALF = (torch.float16, torch.bfloat16)


def _lowp(*tensors: Tensor) -> bool:
    """Whether the operands go to ``tl.dot`` in half precision as they are: one shared dtype, float16, or
    bfloat16 on CUDA (the triton interpreter multiplies bfloat16 operands wrongly: there they widen to
    float32, as do mixed dtypes)."""
    dt = tensors[0].dtype
    if any(t.dtype != dt for t in tensors):
        return False
    return dt == torch.float16 or (dt == torch.bfloat16 and tensors[0].device.type == "cuda")


_MODES = ("causal", "reverse", "full")
#: positions per chunk: at most 64
_MAX_TILE = 64
#: ``(BLOCK_K, BLOCK_W, num_warps, num_stages)`` of the state kernel, then of the output kernel, by operand kind:
#: the largest tiles (at most 64 x 64) for which ptxas (sm_90, triton 3.9, 64-position chunks) reported no register
#: spills; chosen without a GPU, not timed. BLOCK_K, BLOCK_W shrink to the widths (not below 16).
_TILES = {"half": ((64, 64, 4, 3), (64, 64, 8, 3)),
          "tf32": ((64, 64, 4, 3), (64, 64, 8, 3)),
          "float32": ((64, 32, 8, 3), (64, 32, 8, 3)),
          "float64": ((64, 32, 8, 1), (32, 32, 8, 2))}


def _precision(kind: str, *operands: Tensor) -> str:
    """``input_precision`` of the products with a float32 operand: for half-precision operands TF32, or 3xTF32
    when one is float16 (TF32 keeps float16's 10-bit mantissa, so TF32 rounding of the float32 factors reached
    float16's own error, amplified in ``dq``; see docs/mechanisms/linear.md); IEEE for float32/float64."""
    if kind not in ("half", "tf32"):
        return "ieee"
    return "tf32x3" if any(t.dtype == torch.float16 for t in operands) else "tf32"


def _meta(tiles: tuple[int, int, int, int], DX: int, DW: int, **consts) -> dict:
    block_k, block_w, num_warps, num_stages = tiles
    return dict(BLOCK_K=_block(DX, block_k), BLOCK_W=_block(DW, block_w), num_warps=num_warps,
                num_stages=num_stages, **consts)


def _chunks(x: Tensor, y: Tensor, w: Tensor, S0: Tensor, z0: Tensor, mode: str, with_den: bool, acc: torch.dtype,
            out: Tensor, den: Tensor, block_l: int) -> tuple[Tensor, Tensor]:
    """The three steps (chunk states, prefix, outputs) with ``block_l`` positions per chunk; writes ``out`` and
    ``den``, returns the final state."""
    N, L, DX = x.shape
    S, DW = y.shape[1], w.shape[2]
    full = mode == "full"
    dev = x.device
    n_key = triton.cdiv(S, block_l)
    lowp = acc == torch.float32 and _lowp(x, y, w)       # a float64 state makes every product float64
    if lowp:
        kind = "half"
    elif acc == torch.float32 and any(t.dtype in _HALF for t in (x, y, w)):
        kind = "tf32"          # half-precision operands with float32 ones: TF32 products of the widened operands
    else:
        kind = str(acc).removeprefix("torch.")
    prec = _precision(kind, x, y, w)
    if not lowp:               # one dtype in the kernels (mixed pointer dtypes spilled registers in ptxas)
        x, y, w = (t.to(acc) for t in (x, y, w))
    tiles_a, tiles_b = _TILES[kind]
    consts = dict(BLOCK_L=block_l, WITH_DEN=with_den, F64=acc == torch.float64, LOWP=lowp,
                  REVERSE=mode == "reverse", PREC=prec)
    # slot 0: the carried state; slots 1..n_key: the chunks' own states (written by the first kernel)
    dS = torch.empty(N, n_key + 1, DX, DW, dtype=acc, device=dev)
    dS[:, 0] = S0
    dz = torch.empty(N, n_key + 1, DX, dtype=acc, device=dev)
    dz[:, 0] = z0
    if N and n_key:
        launch(_chunk_state_kernel, lambda m: (N * n_key, triton.cdiv(max(DX, 1), m["BLOCK_K"]),
                                               triton.cdiv(max(DW, 1), m["BLOCK_W"])),
               (y, w, dS, dz, S, DX, DW, n_key, y.stride(0), y.stride(1), w.stride(0), w.stride(1), dS.stride(0),
                dS.stride(1), dz.stride(0), dz.stride(1)), _meta(tiles_a, DX, DW, **consts),
               shrink=("BLOCK_K", "BLOCK_W"))
    if full:
        SF = dS.sum(1)
        zF = dz.sum(1) if with_den else z0.to(acc, copy=True)
        state, zstate = SF.unsqueeze(1), zF.unsqueeze(1)              # every chunk reads slot 0 (stride 0)
        s_stride, z_stride = 0, 0
    else:
        dS.cumsum_(1)                                     # slot s: S0 and the chunks at slots 1..s
        SF = dS[:, -1].clone()
        if with_den:
            dz.cumsum_(1)
        zF = dz[:, -1].clone() if with_den else z0.to(acc, copy=True)
        state, zstate = dS, dz
        s_stride, z_stride = dS.stride(1), dz.stride(1)
    n_query = triton.cdiv(L, block_l)
    if N and n_query:
        den_arg = den if with_den else torch.empty(1, 1, dtype=acc, device=dev)
        launch(_chunk_out_kernel, lambda m: (N * n_query, triton.cdiv(max(DW, 1), m["BLOCK_W"])),
               (x, y, w, state, zstate, out, den_arg, L, DX, DW, n_query,
                x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1), den_arg.stride(0),
                state.stride(0), s_stride, zstate.stride(0), z_stride),
               _meta(tiles_b, DX, DW, INTRA=not full, **consts), shrink=("BLOCK_K", "BLOCK_W"))
    return SF, zF


def _product(x: Tensor, y: Tensor, w: Tensor, S0: Tensor, z0: Tensor, mode: str, chunk: int, with_den: bool,
             normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The product primitive (see :mod:`.numba_ops`) with the chunk-parallel triton kernels; ``chunk`` rounds
    up to a power of two >= 16, at most 64 (positions per chunk: it changes rounding only, never the result's
    layout, and halves, not below 16, when a launch runs out of shared memory)."""
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
    block_l = _block(chunk, _MAX_TILE)
    while True:
        try:
            SF, zF = _chunks(x, y, w, S0, z0, mode, with_den, acc, out, den, block_l)
            break
        except Exception as exc:     # the chunk size fixes the states' layout: both kernels rerun with halves
            if not _is_out_of_resources(exc) or block_l <= MIN_TILE:
                raise
            block_l //= 2
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
