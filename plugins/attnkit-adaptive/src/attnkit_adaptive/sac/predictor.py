"""The edge predictor of ``sparse-adaptive``: low-rank query-key scores plus a learned distance encoding."""

from __future__ import annotations

import torch
from torch import Tensor


def distance_bucket(d: Tensor, buckets: int) -> Tensor:
    """Bucket of a distance ``|i - j|``: 0, 1, 2-3, 4-7, ... (log2), the last bucket open-ended."""
    return torch.clamp(torch.floor(torch.log2(d.to(torch.float64) + 1)).long(), max=buckets - 1)


def allowed_pairs(rows: Tensor, S: int, L: int, *, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """bool ``(B' , 1, R, S)``: which keys the query rows ``rows`` may reach (causal bottom-right, key padding)."""
    j = torch.arange(S, device=rows.device)
    keep = torch.ones(rows.shape[0], S, dtype=torch.bool, device=rows.device)
    if causal:
        keep = j[None, :] <= rows[:, None] + (S - L)
    keep = keep[None, None]
    if key_padding_mask is not None:
        keep = keep & key_padding_mask[:, None, None, :]
    return keep
