"""The span mechanisms' compute path: causal attention on a band of key blocks whose width follows the span.

Soft span masking (Sukhbaatar et al. 2019): query ``i`` weights key ``j``
(distance ``x = i - j >= 0``) by ``m_z(x) = clamp((R + z - x) / R, 0, 1)``::

    a_ij = m_z(x) exp(s_ij) / sum_j' m_z(x') exp(s_ij')

``m_z(x) = 0`` once ``x >= z + R``, so a query never needs keys further back
than ``ceil(z_max + R) - 1``. :func:`span_band_attention` splits the queries
into blocks of ``block_size`` and gives each block the keys of its own block
and of the ``nb = ceil((ceil(z_max + R) - 1) / block_size)`` blocks before it
(one ``unfold`` of the keys and values); keys beyond the largest current span,
rounded up to a block, are never read. The soft mask enters as a log-weight,
``softmax(s + log m_z)`` (= ``m_z exp(s) / sum m_z exp(s)``, ``log 0 = -inf``), so
a block is two batched matmuls and one fused softmax. Cost
``O(L·(nb + 1)·block_size·D)``, memory ``O(L·(nb + 1)·block_size)`` scores;
autograd gives the gradients of q, k, v and of the spans (through ``log m_z``).

Why not the sparse engine (:mod:`attnkit_sparse.engine`): its kernels run a
*bool* block mask and refuse an additive bias, and they return no row
log-sum-exp, so the ramp (a multiplicative weight in (0, 1)) can be neither
passed in nor combined afterwards. The band path is plain batched matmuls on
blocks; ``benchmarks/bench_adaptive.py`` measures it against the engine's hard
causal window of the same width (see the plugin README).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.transforms import chunk_count, symbolic

__all__ = ["band_blocks", "span_band_attention"]


def band_blocks(z_max: float, ramp: float, block_size: int, num_blocks: int | None) -> int:
    """How many key blocks before its own a query block needs: every key at distance < ``z_max + ramp``
    (at most ``num_blocks - 1``; ``num_blocks`` None: no cap)."""
    far = max(math.ceil(z_max + ramp) - 1, 0)  # the largest distance with m_z > 0
    nb = math.ceil(far / block_size)
    return nb if num_blocks is None else min(nb, max(num_blocks - 1, 0))


def _traced_band_blocks(z: Tensor, ramp: float, block_size: int, num_blocks: int | None,
                        z_bound: float) -> torch.SymInt:
    """:func:`band_blocks` of the spans' maximum while ``torch.export`` traces: tensor operators (the same
    float64 arithmetic as the eager host path) read with ``.item()``, so the band width is an unbacked size
    of the program that follows the spans' values at run time, asserted in ``[0, band_blocks(z_bound)]``."""
    top = band_blocks(float(z_bound), ramp, block_size, num_blocks)
    if top == 0:   # one block of a static length, or a bound within the ramp: no band whatever the spans
        return 0
    flat = torch.nan_to_num(z.reshape(-1), nan=0.0, posinf=0.0)
    z_max = torch.cat([flat, flat.new_zeros(1)]).max().double()   # the appended 0: no spans gives 0 too
    far = torch.ceil(z_max + ramp).sub(1).clamp_min(0)
    nb = torch.ceil(far / block_size).clamp_max(top).to(torch.int64).item()
    torch._check(nb >= 0)
    torch._check(nb <= top)
    return nb


def span_band_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor, ramp: float, *, scale: float,
                        key_padding_mask: Tensor | None = None, block_size: int = 64,
                        z_bound: float | None = None) -> Tensor:
    """Causal soft-span attention on the band of key blocks the spans reach.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, L, D)``; v: ``(B, H, L, E)`` (self-attention, causal).
        z: spans in positions, broadcastable to ``(B, H, L)`` as ``(B or 1, H, L or 1)``
            (per head: ``(1, H, 1)``; per query: ``(B, H, L)``); may require grad.
        ramp: R > 0, the width of the soft ramp.
        scale: multiplier of ``q · k``.
        key_padding_mask: bool ``(B, L)``, True = a real key, or None.
        block_size: query and key block size.
        z_bound: an upper bound of the spans (the module's ``max_span``). While ``torch.export`` traces (and
            it is given), the band's block count is computed from the spans with tensor operators and read with
            ``.item()``: an unbacked size of the program, asserted within the band of the bound, so a program's
            band follows the spans' values at run time as the eager band does (the windows then gathered by
            index: ``unfold`` takes no unbacked width).

    Returns:
        ``(B, H, L, E)``; a query that sees no real key gets 0.
    """
    B, H, L, D = q.shape
    E = v.shape[-1]
    C = block_size
    dynamic = symbolic(L)
    # a length torch.export traces as dynamic: the block count an unbacked size (a backed ceil(L / C) draws
    # guards the shape solver cannot prove for every length), the band not capped by it (keys before the
    # sequence are invalid below anyway)
    nq = chunk_count(L, C) if dynamic else -(-L // C)
    Lp = nq * C
    zd = z.detach()
    if z_bound is not None and torch.compiler.is_exporting():
        nb = _traced_band_blocks(zd, ramp, C, None if dynamic else nq, z_bound)
    else:
        z_max = float(torch.nan_to_num(zd, nan=0.0, posinf=0.0).clamp_min(0).max()) if zd.numel() else 0.0
        nb = band_blocks(z_max, ramp, C, None if dynamic else nq)
    W = (nb + 1) * C
    dev = q.device
    qc = F.pad(q, (0, 0, 0, Lp - L)).view(B, H, nq, C, D)
    ar_c = torch.arange(C, device=dev)
    ar_w = torch.arange(W, device=dev)
    band = torch.arange(nq, device=dev)[:, None] * C + ar_w[None, :]          # padded key index, (nq, W)
    if isinstance(nb, int):
        kw = F.pad(k, (0, 0, nb * C, Lp - L)).unfold(2, W, C).contiguous()    # (B, H, nq, D, W)
        vw = F.pad(v, (0, 0, nb * C, Lp - L)).unfold(2, W, C).transpose(-1, -2).contiguous()  # (B, H, nq, W, E)
    else:
        # an unbacked band (exporting): unfold cannot take a window of unbacked width; a gather of the
        # same windows can
        kw = F.pad(k, (0, 0, nb * C, Lp - L))[:, :, band].transpose(-1, -2)   # (B, H, nq, D, W)
        vw = F.pad(v, (0, 0, nb * C, Lp - L))[:, :, band]                     # (B, H, nq, W, E)
    s = torch.matmul(qc, kw) * scale                                           # (B, H, nq, C, W)
    x = (ar_c[:, None] + nb * C - ar_w[None, :]).to(q.dtype)                   # distance i - j, (C, W)
    keypos = band - nb * C                                                     # (nq, W)
    # keys before the sequence are invalid; the zero keys padded after it are seen only by the padded
    # queries (a real query never looks forward), which keeps every padded row's diagonal: no empty row
    valid = (keypos >= 0)[None, None, :, None, :]                               # (1, 1, nq, 1, W)
    if key_padding_mask is not None:
        kp = F.pad(F.pad(key_padding_mask, (0, Lp - L), value=True), (nb * C, 0), value=False)
        kpw = kp.unfold(1, W, C) if isinstance(nb, int) else kp[:, band]        # (B, nq, W)
        valid = valid & kpw[:, None, :, None, :]                                # (B, 1, nq, 1, W)
    zb = z if z.dim() == 3 else z.reshape(z.shape[-3:])
    if zb.shape[-1] == 1:
        zc = zb[..., None, None]                                                # (Bz, H, 1, 1, 1)
    else:
        zc = F.pad(zb, (0, Lp - L)).view(zb.shape[0], H, nq, C, 1)
    # the soft mask as a log-weight: log m_z(x) on its support, -inf elsewhere (and at invalid keys), so
    # that m · exp(s) / sum(m · exp(s)) is one fused softmax of s + log m
    m = ((ramp + zc - x) / ramp).clamp(0.0, 1.0)                               # (Bz, H, nq|1, C, W)
    on = (m > 0) & (x >= 0)
    one = torch.ones((), dtype=q.dtype, device=dev)
    logm = torch.where(on, torch.log(torch.where(on, m, one)), torch.full((), float("-inf"), dtype=q.dtype,
                                                                          device=dev))
    logm = logm.masked_fill(~valid, float("-inf"))
    s = s + logm
    if key_padding_mask is None:
        p = torch.softmax(s, dim=-1)  # every real query sees itself (m_z(0) = 1): no empty row
    else:
        row_any = (valid & on).any(-1, keepdim=True)
        p = torch.softmax(torch.where(row_any, s, torch.zeros((), dtype=s.dtype, device=dev)), dim=-1)
        p = p * row_any
    out = torch.matmul(p, vw)
    return out.reshape(B, H, Lp, E)[:, :, :L]
