"""Shared helpers of the adaptive plugin's tests (tiny shapes: the whole session stays well under 3 minutes)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def qkv():
    def make(L, S=None, B=2, H=2, D=8, E=6, seed=0, dtype=torch.float64, grad=False):
        g = torch.Generator().manual_seed(seed)
        S = L if S is None else S
        ts = (torch.randn(B, H, L, D, generator=g, dtype=dtype), torch.randn(B, H, S, D, generator=g, dtype=dtype),
              torch.randn(B, H, S, E, generator=g, dtype=dtype))
        return tuple(t.requires_grad_() for t in ts) if grad else ts
    return make
