"""Plain reference of the engine: the dense masked softmax built from the same mask function."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask
from attnkit.positions import Positions


def reference_attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, *, scale: float | None = None,
                     positions: Positions | None = None) -> Tensor:
    """Dense ``softmax(scale·q kᵀ masked) v``; rows with no allowed key are 0. Materialises ``(B, H, L, S)``.

    float16 and bfloat16 inputs are computed in float32 (scores, an additive bias, softmax, the sum) and the
    output is cast back to the input dtype.
    """
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        return reference_attend(q.float(), k.float(), v.float(), mask, scale=scale, positions=positions).to(dtype)
    B, H, L, D = q.shape
    S = k.shape[-2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        geom = Geometry(B, H, L, S, q.device, positions)
        keep = mask.dense(geom)
        bias = mask.bias(geom, scores.dtype)
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~keep, float("-inf"))
        any_ = keep.any(-1, keepdim=True)
        scores = scores.masked_fill(~any_, 0.0)
        p = torch.softmax(scores, dim=-1).masked_fill(~keep, 0.0)
        p = p * any_
    else:
        p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, v)
