"""The plain reference of ``sinkhorn``: the same sorted blocks, the explicit dense mask, masked softmax.

Keys and values are extended with the sorted blocks (``[k; S·k_blocks]``,
``[v; S·v_blocks]``, from the same sorting matrix); the dense bool mask
``(NB·b, 2·NB·b)`` lets query block ``i`` see its own block (causal: up to
itself; never the end padding) and sorted block ``i`` (causal: not for block 0).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .sorting import pad_blocks, sorted_blocks

__all__ = ["reference", "dense_mask"]


def dense_mask(L: int, b: int, causal: bool, device: torch.device) -> Tensor:
    """bool ``(NB·b, 2·NB·b)``."""
    nb = -(-L // b)
    n = nb * b
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    own = (i // b == j // b) & (j < L)
    if causal:
        own = own & (j <= i)
    srt = (i // b) == (j // b)
    if causal:
        srt = srt & (i // b > 0)
    return torch.cat([own, srt], 1)


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Any = None, positions: Any = None) -> Tensor:
    """``sinkhorn`` the O(L²) way, ``(B, H, L, E)``, with ``attn``'s sorting network (eval: no noise)."""
    causal = mask is not None and mask.is_causal
    B, H, L, _ = q.shape
    b = min(attn.block_size, L)
    s = attn.sort_matrix(k, causal=causal, scaling=False)        # log-domain Sinkhorn iterations
    kx = torch.cat([pad_blocks(k, b), sorted_blocks(k, s, b)], 2)
    vx = torch.cat([pad_blocks(v, b), sorted_blocks(v, s, b)], 2)
    keep = dense_mask(L, b, causal, q.device)
    scores = torch.matmul(pad_blocks(q, b), kx.transpose(-1, -2)) * attn.get_scale(q)
    any_ = keep.any(-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")).masked_fill(~any_, 0.0), -1) * any_
    return torch.matmul(p, vx)[:, :, :L]
