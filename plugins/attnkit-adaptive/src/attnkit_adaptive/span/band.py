"""The span mechanisms' compute path: causal attention on a band of key blocks whose width follows the span.

Soft span masking (Sukhbaatar et al. 2019): query ``i`` weights key ``j``
(distance ``x = i - j >= 0``) by ``m_z(x) = clamp((R + z - x) / R, 0, 1)``::

    a_ij = m_z(x) exp(s_ij) / sum_j' m_z(x') exp(s_ij')

``m_z(x) = 0`` once ``x >= z + R``, so a query never needs keys further back
than ``ceil(z_max + R) - 1``. :func:`span_band_attention` splits the queries
into blocks of ``block_size`` and gives each block the keys of its own block
and of the ``nb = ceil((ceil(z_max + R) - 1) / block_size)`` blocks before it
(one ``unfold`` of the keys and values); keys beyond the largest current span,
rounded up to a block, are never read. Cost ``O(L·(nb + 1)·block_size·D)``,
memory ``O(L·(nb + 1)·block_size)`` scores; autograd gives the gradients of
q, k, v and of the spans (through ``m_z``).

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

__all__ = ["band_blocks", "span_band_attention"]


def band_blocks(z_max: float, ramp: float, block_size: int, num_blocks: int) -> int:
    """How many key blocks before its own a query block needs: every key at distance < ``z_max + ramp``."""
    far = max(math.ceil(z_max + ramp) - 1, 0)  # the largest distance with m_z > 0
    return min(math.ceil(far / block_size), max(num_blocks - 1, 0))


def span_band_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor, ramp: float, *, scale: float,
                        key_padding_mask: Tensor | None = None, block_size: int = 64) -> Tensor:
    """Causal soft-span attention on the band of key blocks the spans reach.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, L, D)``; v: ``(B, H, L, E)`` (self-attention, causal).
        z: spans in positions, broadcastable to ``(B, H, L)`` as ``(B or 1, H, L or 1)``
            (per head: ``(1, H, 1)``; per query: ``(B, H, L)``); may require grad.
        ramp: R > 0, the width of the soft ramp.
        scale: multiplier of ``q · k``.
        key_padding_mask: bool ``(B, L)``, True = a real key, or None.
        block_size: query and key block size.

    Returns:
        ``(B, H, L, E)``; a query that sees no real key gets 0.
    """
    B, H, L, D = q.shape
    E = v.shape[-1]
    C = block_size
    nq = -(-L // C)
    Lp = nq * C
    zd = z.detach()
    z_max = float(torch.nan_to_num(zd, nan=0.0, posinf=0.0).clamp_min(0).max()) if zd.numel() else 0.0
    nb = band_blocks(z_max, ramp, C, nq)
    W = (nb + 1) * C
    dev = q.device
    qc = F.pad(q, (0, 0, 0, Lp - L)).view(B, H, nq, C, D)
    kw = F.pad(k, (0, 0, nb * C, Lp - L)).unfold(2, W, C)                     # (B, H, nq, D, W)
    vw = F.pad(v, (0, 0, nb * C, Lp - L)).unfold(2, W, C).transpose(-1, -2)   # (B, H, nq, W, E)
    s = torch.matmul(qc, kw) * scale                                           # (B, H, nq, C, W)
    ar_c = torch.arange(C, device=dev)
    ar_w = torch.arange(W, device=dev)
    x = (ar_c[:, None] + nb * C - ar_w[None, :]).to(q.dtype)                   # distance i - j, (C, W)
    keypos = torch.arange(nq, device=dev)[:, None] * C - nb * C + ar_w[None, :]  # (nq, W)
    valid = ((keypos >= 0) & (keypos < L))[None, None, :, None, :]              # (1, 1, nq, 1, W)
    if key_padding_mask is not None:
        kp = F.pad(key_padding_mask, (nb * C, Lp - L), value=False).unfold(1, W, C)  # (B, nq, W)
        valid = valid & kp[:, None, :, None, :]
    zb = z if z.dim() == 3 else z.reshape(z.shape[-3:])
    if zb.shape[-1] == 1:
        zc = zb[..., None, None]                                                # (Bz, H, 1, 1, 1)
    else:
        zc = F.pad(zb, (0, Lp - L)).view(zb.shape[0], H, nq, C, 1)
    m = ((ramp + zc - x) / ramp).clamp(0.0, 1.0) * (x >= 0).to(q.dtype)        # (Bz, H, nq|1, C, W)
    allowed = valid & (m > 0)
    s = s.masked_fill(~allowed, float("-inf"))
    mx = s.detach().amax(-1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros((), dtype=mx.dtype, device=dev), mx)
    p = torch.exp(s - mx) * m
    den = p.sum(-1, keepdim=True)
    out = torch.matmul(p, vw)
    out = out / torch.where(den > 0, den, torch.ones((), dtype=den.dtype, device=dev))
    return out.reshape(B, H, Lp, E)[:, :, :L]
