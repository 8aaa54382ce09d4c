"""Tolerances and helpers shared by the tests that compare two paths (torch, numba, triton, reference)."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-8)}


def close(a, b, dtype, factor=1.0):
    """assert_close at the dtype's tolerance, scaled by ``factor``."""
    torch.testing.assert_close(a, b, atol=TOL[dtype]["atol"] * factor, rtol=TOL[dtype]["rtol"] * factor)


def rand(shape, seed, dtype, positive=False):
    """A seeded leaf tensor needing grad: uniform [0, 1) when ``positive``, else standard normal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64) if positive else \
        torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(dtype).requires_grad_()


def grads(outs, inputs, seed=3, allow_unused=False):
    """Gradients of ``inputs`` under a seeded random projection of ``outs``."""
    g = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum() for o in outs)
    return torch.autograd.grad(total, inputs, allow_unused=allow_unused)
