"""The span mechanisms' ``numba`` backend: the soft-span band as fused CPU kernels behind a ``torch.autograd.Function``.

:func:`span_band_attention_numba` computes exactly what
:func:`attnkit_adaptive.span.band.span_band_attention` (the torch path) and the
plain reference compute, the soft mask ``m_z(i - j) = clamp((R + z - (i - j)) / R, 0, 1)``
as a weight in an online softmax, with the gradients of q, k, v **and of the
spans** (per head or per query). Each query reads only the keys its own span
reaches (``i - j < z_i + R``), so the cost is
``O(L · (z + R) · D)``; no score matrix and no band of whole blocks is
materialised. Kernels: :mod:`._numba_kernels`. float32 and float64, CPU.

Threads: the kernels are serial ``nogil`` functions over ranges of work items, run on
``torch.get_num_threads()`` threads (:func:`attnkit.numba_pool.run_ranges`, a team of torch's OpenMP pool); a
thread slowed by another process on the cores takes fewer ranges.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit.first_order import first_order
from attnkit.numba_pool import kernel_threads, run_ranges

from . import _numba_kernels as K

__all__ = ["span_band_attention_numba"]

#: the backward is one query-major kernel (:func:`._numba_kernels.backward_fused`); FUSED_CHUNKS: query-block
#: chunks per row (None: about 4 work items per thread); FUSED_BLOCK: query rows per block (None: the forward's)
FUSED_CHUNKS: int | None = None
FUSED_BLOCK: int | None = None
#: the forward keeps each row's scores over its reach (B·H·L·(far + 1) floats) for the fused backward when they fit
#: in this many bytes (4 tile products per query block instead of 5); above, the backward recomputes Q Kᵀ
SCORES_MAX_BYTES = 512 << 20


def _run(kernel: Any, items: int, *args: Any) -> None:
    """``kernel(*args, i0, i1)`` over the work items ``0 <= i < items``, in ranges on torch's thread count."""
    run_ranges(kernel, items, *args)


def _np(x: Tensor) -> np.ndarray:
    return x.detach().contiguous().numpy()


def _flat(x: Tensor) -> np.ndarray:
    """``(B, H, L, F)`` or ``(B, H, L)`` -> contiguous NumPy with B·H leading."""
    return _np(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))


class _SpanBand(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, z: Tensor, ramp: float, scale: float,
                kpm: Tensor | None, bq: int, bk: int, grad: bool) -> Tensor:
        B, H, L, D = q.shape
        E = v.shape[-1]
        zf = z.detach().to(q.dtype).expand(B, H, L).contiguous()
        # the first key each query may reach: the pair (i, j) counts iff (R + z_i) - (i - j) > 0, i.e.
        # i - j <= ceil(R + z_i) - 1 (R + z_i in the dtype, as the kernels add them); lo_i = i + 1 for none
        reach = torch.nan_to_num(zf + torch.tensor(ramp, dtype=q.dtype), nan=0.0, posinf=float(L + 1),
                                 neginf=0.0).clamp(0.0, float(L + 1))
        far_i = torch.ceil(reach).to(torch.int64) - 1                              # -1 .. L
        pos = torch.arange(L, dtype=torch.int64)
        lo = (pos - far_i).clamp_min(0).to(torch.int32)
        far = far_i.clamp_min(0).reshape(B * H, L).amax(-1).to(torch.int32)
        kp = (torch.ones(1, L, dtype=torch.uint8) if kpm is None else kpm.to(torch.uint8)).contiguous()
        xs = torch.arange(L, dtype=q.dtype)
        qs = q.detach()
        cst = K.constants(_np(qs).dtype, float(ramp), float(scale))
        f32 = q.dtype == torch.float32
        nq = -(-L // bq)
        fmax = int(far.max()) if far.numel() else 0
        save = grad and B * H * L * (fmax + 1) * q.element_size() <= SCORES_MAX_BYTES
        sbuf = np.empty((B * H, L, fmax + 1) if save else (1, 1, 1), dtype=cst.dtype)
        out = np.empty((B * H, L, E), dtype=cst.dtype)
        lse = np.empty((B * H, L), dtype=cst.dtype)
        _run(K.forward, B * H * nq, _flat(qs), _flat(k), _flat(v), _flat(zf), _flat(lo), _np(kp), _np(xs), H, bq, bk,
             cst, f32, _np(far), save, sbuf, out, lse)
        out_t = torch.from_numpy(out).view(B, H, L, E)
        nan_z = torch.isnan(zf)
        if bool(nan_z.any()):  # a NaN span (dynamic-span predicts it from a NaN query): NaN in, NaN out
            out_t = out_t.masked_fill(nan_z[..., None], float("nan"))
        ctx.save_for_backward(qs, k.detach(), v.detach(), zf, lo, far, kp, xs, out_t,
                              torch.from_numpy(lse))
        ctx.meta = (scale, float(ramp), bq, bk, tuple(z.shape))
        ctx.sbuf = sbuf if save else None
        return out_t

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        qs, k, v, zf, lo, far, kp, xs, out, lse = ctx.saved_tensors
        scale, ramp, bq, _, zshape = ctx.meta   # the key tile is the forward's alone
        B, H, L, D = qs.shape
        E = v.shape[-1]
        g = g.contiguous()
        cst = K.constants(_np(qs).dtype, ramp, scale)
        f32 = qs.dtype == torch.float32
        sbuf = ctx.sbuf if ctx.sbuf is not None else np.empty((1, 1, 1), dtype=cst.dtype)
        bq = FUSED_BLOCK or bq
        nqb = -(-L // bq)
        nc = FUSED_CHUNKS or min(nqb, max(1, -(-4 * kernel_threads() // (B * H))))
        cb = -(-nqb // nc)
        chunks = -(-nqb // cb)
        sp = int(far.max()) if far.numel() else 0     # spill rows per chunk: the widest reach
        dt = cst.dtype
        dq_a, dk_a, dv_a = (np.empty((B * H, L, D), dt), np.empty((B * H, L, D), dt), np.empty((B * H, L, E), dt))
        dz_a = np.empty((B * H, L), dt)
        spk, spv = np.zeros((B * H * chunks, sp, D), dt), np.zeros((B * H * chunks, sp, E), dt)
        _run(K.backward_fused, B * H * chunks, _flat(qs), _flat(k), _flat(v), _flat(out), _flat(g), _np(lse),
             _flat(zf), _flat(lo), _np(far), _np(kp), _np(xs), H, bq, cb, cst, f32, ctx.sbuf is not None, sbuf,
             dq_a, dk_a, dv_a, dz_a, spk, spv)
        if chunks > 1 and sp > 0:
            _run(K.add_spill, B * H, dk_a, dv_a, spk, spv, bq, cb)
        dq = torch.from_numpy(dq_a).view(B, H, L, D) if ctx.needs_input_grad[0] else None
        dk = torch.from_numpy(dk_a).view(B, H, L, D) if ctx.needs_input_grad[1] else None
        dv = torch.from_numpy(dv_a).view(B, H, L, E) if ctx.needs_input_grad[2] else None
        dz = torch.from_numpy(dz_a).view(B, H, L).sum_to_size(zshape) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dz, None, None, None, None, None, None


def span_band_attention_numba(q: Tensor, k: Tensor, v: Tensor, z: Tensor, ramp: float, *, scale: float,
                              key_padding_mask: Tensor | None = None, block_size: int = 64,
                              key_block: int | None = None) -> Tensor:
    """Causal soft-span attention with the numba kernels; differentiable in q, k, v and z.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, L, D)``; v: ``(B, H, L, E)`` (causal self-attention), float32 or
            float64 CPU tensors of one dtype.
        z: spans in positions, broadcastable to ``(B, H, L)`` (per head ``(1, H, 1)``, per query
            ``(B, H, L)``); its gradient has z's shape.
        ramp: R > 0.
        scale: multiplier of ``q · k``.
        key_padding_mask: bool ``(B, L)``, True = a real key, or None. Padded keys never count, but a
            group of 4 query rows multiplies a weight of 0 by the values of the keys any of them reaches, so
            padded (and out-of-span) keys must hold finite values: the module zeroes padded keys and values,
            as attnkit does for every implementation.
        block_size: query rows per work item (and per score tile).
        key_block: keys per score tile (default ``block_size``).

    Returns:
        ``(B, H, L, E)``; a query that sees no real key gets 0.

    Raises:
        ValueError: tensors that are not float32/float64 on the CPU, or of different dtypes.
    """
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or not (
            q.dtype == k.dtype == v.dtype):
        raise ValueError(f"span_band_attention_numba: expected float32 or float64 CPU tensors of one dtype, got "
                         f"q {q.dtype} on {q.device}, k {k.dtype}, v {v.dtype}")
    bq = int(block_size)
    bk = int(key_block or block_size)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, z))
    return _SpanBand.apply(q, k, v, z, float(ramp), float(scale), key_padding_mask, bq, bk, grad)
