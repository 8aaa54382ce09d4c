"""Coordinate embeddings of the Universal Transformer: sinusoids of the position and of the recurrence step."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sinusoid(index: Tensor, dim: int) -> Tensor:
    """``[sin(i / 10000^(2k/dim)), cos(i / 10000^(2k/dim))]`` for each index, ``(*index.shape, dim)``."""
    half = (dim + 1) // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64, device=index.device) * 2 / dim)
    ang = index.to(torch.float64)[..., None] * freq
    return torch.cat([ang.sin(), ang.cos()], dim=-1)[..., :dim]


def coordinates(L: int, step: int, dim: int, *, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Position ``0..L-1`` plus step ``step`` embeddings, ``(L, dim)`` (Dehghani et al. 2019, eq. 4)."""
    pos = sinusoid(torch.arange(L, device=device), dim)
    stp = sinusoid(torch.tensor([step], device=device), dim)
    return (pos + stp).to(dtype)
