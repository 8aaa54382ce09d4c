"""Shared helpers of the adaptive plugin's tests (tiny shapes: the whole session stays well under 3 minutes)."""

from __future__ import annotations

import os

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


# ------------------------------------------------ numba builds split between pytest-xdist workers
def _warm_span_numba(dtype: torch.dtype) -> None:
    """One tiny forward+backward of the span band on numba in ``dtype``: numba builds the forward and the fused
    backward for that dtype (or loads them from its cache)."""
    from attnkit_adaptive.span.numba_band import span_band_attention_numba

    g = torch.Generator().manual_seed(0)   # its own generator: the tests' random draws stay as they were
    q, k, v = (torch.randn(1, 1, 8, 4, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    z = torch.full((1, 1, 1), 4.0, dtype=dtype, requires_grad=True)
    span_band_attention_numba(q, k, v, z, 2.0, scale=0.5, block_size=4).sum().backward()


def pytest_collection_finish(session: pytest.Session) -> None:
    """With several pytest-xdist workers, each first builds its share of the span kernels (float64 on the first
    worker, float32 on the second) before its tests start.

    Without it both workers' first span tests needed the same builds at the same moment and each compiled them
    (numba writes its cache only when a build ends): about 157 s of the suite's 526 s of compiling were the same
    forward and fused backward built twice (session 33, 2-core VM). Each build now runs once, the other worker
    loads it from the cache when its tests reach it. Only when span tests were collected.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return
    if not any("span" in item.nodeid.lower() for item in session.items):
        return
    me = int(worker[2:])
    for i, dtype in enumerate((torch.float64, torch.float32)):
        if i % count == me:
            try:
                _warm_span_numba(dtype)
            except Exception:  # noqa: BLE001 -- a broken span path fails its own tests, with their names; not here
                pass
