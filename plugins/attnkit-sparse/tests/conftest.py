"""Shared helpers of the sparse plugin's tests (tiny shapes: the whole plugin session stays well under 3 minutes)."""

from __future__ import annotations

import pytest
import torch

from attnkit.masks import Geometry


def dense(mask, L, S=None, B=1, H=1, positions=None):
    """The mask as bool ``(B', H', L, S)``, evaluated element by element."""
    S = L if S is None else S
    return mask.dense(Geometry(B, H, L, S, torch.device("cpu"), positions))


def rand(shape, seed):
    """float64 normal draws from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def proj_sum(out, seed=5):
    """A scalar that weights every output entry differently (a fixed random projection), for gradients."""
    return (out * rand(out.shape, seed)).sum()


@pytest.fixture
def qkv():
    def make(L, S=None, B=2, H=2, D=8, E=6, seed=0, dtype=torch.float64):
        g = torch.Generator().manual_seed(seed)
        S = L if S is None else S
        return (torch.randn(B, H, L, D, generator=g, dtype=dtype), torch.randn(B, H, S, D, generator=g, dtype=dtype),
                torch.randn(B, H, S, E, generator=g, dtype=dtype))
    return make
