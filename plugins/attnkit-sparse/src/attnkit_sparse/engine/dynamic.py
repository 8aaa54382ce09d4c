"""Banded attention for a length ``torch.export`` traces as dynamic: no block plan, one program for every length.

A block plan is built from the length (Python integers), so a program holding one fixes the length. A
pattern whose allowed pairs lie in a position band, ``lo <= q - k <= hi`` with both bounds finite
(:meth:`attnkit.masks.Mask._reach`: sliding windows, dilated bands, block bands), needs no plan: split the
padded sequence into ``N`` chunks of ``C`` positions (``N`` from :func:`attnkit.transforms.chunk_count`, a
size of its own), give each query chunk the ``K`` key chunks the band can reach (``K`` depends on the band
and ``C`` only), evaluate the whole mask at every gathered pair (the pattern, the causal rule and any mask
input such as a key padding mask) and take the masked softmax there. Work and memory ``O(L·K·C·(D + E))``:
the band's width, not the length. The result is the engine's (same allowed pairs, rows with no allowed key
give 0); only rounding differs from the plan's tiles.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.masks import Geometry, Mask
from attnkit.transforms import chunk_count

#: positions per chunk when the band is narrow (a wider band takes chunks near its width)
MIN_CHUNK = 16
MAX_CHUNK = 128


def band_of(mask: Mask | None) -> tuple[int, int] | None:
    """``(lo, hi)``, finite bounds of ``q - k`` over the allowed pairs of ``mask``, or None."""
    reach = None if mask is None else mask._reach()
    if reach is None or not all(math.isfinite(r) and abs(r) < 2 ** 40 for r in reach):
        return None
    return int(math.floor(reach[0])), int(math.ceil(reach[1]))


def attend_band(q: Tensor, k: Tensor, v: Tensor, mask: Mask, band: tuple[int, int], scale: float) -> Tensor:
    """Masked softmax attention of ``q (B, H, L, D)`` over ``k, v (B, H, L, *)`` (self-attention: one length)
    where every allowed pair has ``lo <= q - k <= hi`` (``band``); ``mask`` is evaluated at each gathered pair.
    Returns ``(B, H, L, E)``; a query with no allowed key gives 0."""
    B, H, L, _ = q.shape
    E = v.shape[-1]
    lo, hi = band
    if lo > hi:                              # an empty band allows nothing
        return q.new_zeros(B, H, L, E) + 0 * v.sum()
    C = max(MIN_CHUNK, min(MAX_CHUNK, 1 << max(0, hi - lo).bit_length()))
    N = chunk_count(L, C)
    first, last = (-hi) // C, (C - 1 - lo) // C   # key chunks i + first .. i + last can hold an allowed key
    left, right = max(0, -first), max(0, last)
    K = last - first + 1

    def padded(x: Tensor, before: int, after: int) -> Tensor:
        return F.pad(x, (0, 0, before * C, N * C - L + after * C))

    qc = padded(q * scale, 0, 0).reshape(B, H, -1, C, q.shape[-1])      # (B, H, N, C, D), scaled once
    kc = padded(k, left, right).reshape(B, H, -1, C, k.shape[-1])       # (B, H, left + N + right, C, D)
    vc = padded(v, left, right).reshape(B, H, -1, C, E)
    # the K key chunks of query chunk i are chunks i + first .. i + last: one slice of whole chunks per offset
    # (contiguous operands for the products, no gathered copies of k and v)
    offsets = [left + o for o in range(first, last + 1)]
    dev = q.device
    start = torch.arange(N, device=dev).mul(C).view(N, 1)                # each chunk's first position
    qpos = start + torch.arange(C, device=dev)                           # (N, C)
    kpos = start + torch.arange(first * C, (last + 1) * C, device=dev)   # (N, K·C)
    qi, ki = qpos.view(1, 1, N, C, 1), kpos.view(1, 1, N, 1, K * C)
    real = (qi < L) & (ki >= 0) & (ki < L) & (qi - ki >= lo) & (qi - ki <= hi)
    geom = Geometry(B, H, L, L, dev, None)
    b = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1, 1)
    # indices outside the sequence clamped for the evaluation (a mask may index a table with them): those
    # pairs are masked by ``real`` whatever the mask says
    keep = real & mask._keep(b, h, qi.clamp(0, L - 1), ki.clamp(0, L - 1), geom)
    # masked scores at the dtype's lowest finite value, not -inf: a row with no allowed key then has a finite
    # (uniform) softmax and finite gradients, and its output is set to 0 below
    s = torch.cat([qc @ kc[:, :, o:o + N].transpose(-1, -2) for o in offsets], dim=-1)   # (B, H, N, C, K·C)
    p = torch.softmax(s.masked_fill_(~keep, torch.finfo(q.dtype).min), dim=-1)
    out = p[..., :C] @ vc[:, :, offsets[0]:offsets[0] + N]
    for n, o in enumerate(offsets[1:], 1):
        out = out + p[..., n * C:(n + 1) * C] @ vc[:, :, o:o + N]       # (B, H, N, C, E)
    out = out.masked_fill(~keep.any(-1, keepdim=True), 0.0)
    return out.reshape(B, H, -1, E)[:, :, :L]
