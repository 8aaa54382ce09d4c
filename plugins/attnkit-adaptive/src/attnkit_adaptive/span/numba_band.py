"""The span mechanisms' ``numba`` backend: the soft-span band as fused CPU kernels behind custom operators.

:func:`span_band_attention_numba` computes exactly what
:func:`attnkit_adaptive.span.band.span_band_attention` (the torch path) and the
plain reference compute, the soft mask ``m_z(i - j) = clamp((R + z - (i - j)) / R, 0, 1)``
as a weight in an online softmax, with the gradients of q, k, v **and of the
spans** (per head or per query). Each query reads only the keys its own span
reaches (``i - j < z_i + R``), so the cost is
``O(L · (z + R) · D)``; no score matrix and no band of whole blocks is
materialised. Kernels: :mod:`._numba_kernels`. float32 and float64, CPU.

:func:`forward` and :func:`backward` run the kernels on real tensors; they are the implementations of the custom
operators ``attnkit_adaptive::span_band`` and ``attnkit_adaptive::span_band_backward`` (:mod:`.ops`, registered
when ``attnkit_adaptive`` is imported, with fake implementations that give the output shapes from the input shapes
and the autograd formula), so ``torch.export`` and ``torch.compile`` hold one operator: what reads values on the
host (each query's reach, the widest reach that sizes the kept scores and the spill rows) runs inside it, at run
time, and a program takes any length.

Threads: the kernels are serial ``nogil`` functions over ranges of work items, run on
``torch.get_num_threads()`` threads (:func:`attnkit.numba_pool.run_ranges`, a team of torch's OpenMP pool); a
thread slowed by another process on the cores takes fewer ranges.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit.numba_pool import kernel_threads, run_ranges

from . import _numba_kernels as K
from .ops import span_band

__all__ = ["backward", "forward", "span_band_attention_numba"]

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


def _spans(q: Tensor, z: Tensor) -> Tensor:
    """``zf (B, H, L)``: the spans in q's dtype, contiguous (z itself when it is already so)."""
    B, H, L, _ = q.shape
    return z.detach().to(q.dtype).expand(B, H, L).contiguous()


def _reach(q: Tensor, zf: Tensor, ramp: float) -> tuple[Tensor, Tensor]:
    """The kernels' reach of each query from the spans ``zf`` (host values, computed once by the forward and kept
    for the backward): ``lo (B, H, L)`` int32 the first key each query may reach, ``far (B·H,)`` int32 the widest
    reach of each row."""
    B, H, L, _ = q.shape
    # the first key each query may reach: the pair (i, j) counts iff (R + z_i) - (i - j) > 0, i.e.
    # i - j <= ceil(R + z_i) - 1 (R + z_i in the dtype, as the kernels add them); lo_i = i + 1 for none
    reach = torch.nan_to_num(zf + torch.tensor(ramp, dtype=q.dtype), nan=0.0, posinf=float(L + 1),
                             neginf=0.0).clamp(0.0, float(L + 1))
    far_i = torch.ceil(reach).to(torch.int64) - 1                              # -1 .. L
    pos = torch.arange(L, dtype=torch.int64)
    lo = (pos - far_i).clamp_min(0).to(torch.int32)
    far = far_i.clamp_min(0).reshape(B * H, L).amax(-1).to(torch.int32)
    return lo, far


def _keys(q: Tensor, kpm: Tensor | None) -> tuple[Tensor, Tensor]:
    """``kp (B', L)`` uint8 key padding (1 = a real key; B' = 1, all ones, without a mask) and ``xs (L,)`` the
    positions in q's dtype."""
    L = q.shape[-2]
    kp = (torch.ones(1, L, dtype=torch.uint8) if kpm is None else kpm.to(torch.uint8)).contiguous()
    return kp, torch.arange(L, dtype=q.dtype)


def forward(q: Tensor, k: Tensor, v: Tensor, z: Tensor, kpm: Tensor | None, ramp: float, scale: float, bq: int,
            bk: int, grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward kernel on real tensors (the implementation of the custom operator
    ``attnkit_adaptive::span_band``, :mod:`.ops`): ``(out (B, H, L, E), lse (B, H, L), scores, lo, far)``.
    With ``grad`` the scaled scores of each row over its reach, ``(B·H, L, far + 1)``, are kept for the backward
    when they fit in :data:`SCORES_MAX_BYTES`; ``scores`` is ``(B·H, L, 0)`` otherwise (the backward recomputes
    them). ``lo, far``: :func:`_reach`, for the backward."""
    B, H, L, D = q.shape
    E = v.shape[-1]
    zf = _spans(q, z)
    lo, far = _reach(q, zf, ramp)
    kp, xs = _keys(q, kpm)
    qs = q.detach()
    cst = K.constants(_np(qs).dtype, float(ramp), float(scale))
    f32 = q.dtype == torch.float32
    nq = -(-L // bq)
    fmax = int(far.max()) if far.numel() else 0
    save = bool(grad) and B * H * L * (fmax + 1) * q.element_size() <= SCORES_MAX_BYTES
    sbuf = np.empty((B * H, L, fmax + 1) if save else (1, 1, 1), dtype=cst.dtype)
    out = np.empty((B * H, L, E), dtype=cst.dtype)
    lse = np.empty((B * H, L), dtype=cst.dtype)
    _run(K.forward, B * H * nq, _flat(qs), _flat(k), _flat(v), _flat(zf), _flat(lo), _np(kp), _np(xs), H, bq, bk,
         cst, f32, _np(far), save, sbuf, out, lse)
    out_t = torch.from_numpy(out).view(B, H, L, E)
    nan_z = torch.isnan(zf)
    if bool(nan_z.any()):  # a NaN span (dynamic-span predicts it from a NaN query): NaN in, NaN out
        out_t = out_t.masked_fill(nan_z[..., None], float("nan"))
    scores = torch.from_numpy(sbuf) if save else q.new_empty(B * H, L, 0)
    return out_t, torch.from_numpy(lse).view(B, H, L), scores, lo, far


def backward(q: Tensor, k: Tensor, v: Tensor, z: Tensor, kpm: Tensor | None, out: Tensor, lse: Tensor,
             scores: Tensor, lo: Tensor, far: Tensor, g: Tensor, ramp: float, scale: float,
             bq: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The fused backward kernel on real tensors (``attnkit_adaptive::span_band_backward``): the gradients of q,
    k, v and z (z's shape and dtype), from the forward's ``out``, ``lse``, kept ``scores`` (none when its last
    dimension is 0) and ``lo, far`` (not recomputed: a few small torch operators, but each can wait on a
    thread of torch's pool that another process holds, ~15 ms on the shared 2-core VM). The key tile is the
    forward's alone."""
    B, H, L, D = q.shape
    E = v.shape[-1]
    zf = _spans(q, z)
    kp, xs = _keys(q, kpm)
    qs = q.detach()
    g = g.contiguous()
    cst = K.constants(_np(qs).dtype, float(ramp), float(scale))
    f32 = qs.dtype == torch.float32
    have_s = scores.shape[-1] > 0
    sbuf = _np(scores) if have_s else np.empty((1, 1, 1), dtype=cst.dtype)
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
    _run(K.backward_fused, B * H * chunks, _flat(qs), _flat(k), _flat(v), _flat(out), _flat(g), _flat(lse),
         _flat(zf), _flat(lo), _np(far), _np(kp), _np(xs), H, bq, cb, cst, f32, have_s, sbuf,
         dq_a, dk_a, dv_a, dz_a, spk, spv)
    if chunks > 1 and sp > 0:
        _run(K.add_spill, B * H, dk_a, dv_a, spk, spv, bq, cb)
    dz = torch.from_numpy(dz_a).view(B, H, L).sum_to_size(z.shape).to(z.dtype)
    return (torch.from_numpy(dq_a).view(B, H, L, D), torch.from_numpy(dk_a).view(B, H, L, D),
            torch.from_numpy(dv_a).view(B, H, L, E), dz)


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
    return span_band(q, k, v, z, key_padding_mask, float(ramp), float(scale), bq, bk, grad)[0]
