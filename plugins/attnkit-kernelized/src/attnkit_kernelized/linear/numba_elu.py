"""``elu(x) + 1`` (linear attention's default feature map) as one numba pass, for the numba backend.

torch evaluates ``F.elu(x) + 1`` in two passes over ``(B, H, L, D)`` (elu, then the
addition, each a fresh tensor) and its backward recomputes the exponential; here one
pass writes ``phi = x + 1`` (``x > 0``) or ``exp(x)`` with the vectorised exp of
:mod:`attnkit_kernelized._vexp`, and the backward is one pass of
``g * min(phi, 1)`` (the derivative of ``elu(x) + 1`` is 1 for ``x > 0`` and
``exp(x) = phi`` otherwise; both give 1 at 0). Only the numba backend uses it
(:meth:`.module.LinearAttention._causal_segment`); the torch path and the plain
reference keep torch's ``F.elu``, against which ``tests/test_linear_numba_elu.py``
checks it.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from torch import Tensor

from attnkit.first_order import first_order

from .._numba import FASTMATH, arr, output, rows
from .._vexp import HALF, constants, elu1_row

_ITEM = 4096   # elements per work item (rows hands out ranges of them; fewer than this: one call, no thread)


@numba.njit(cache=True, nogil=True)
def _elu_rows(x, out, cst, is32, i0, i1):  # pragma: no cover - compiled
    """``out[i] = x[i] + 1 if x[i] > 0 else exp(x[i])`` for ``i0 <= i < i1`` (flat arrays; NaN stays NaN)."""
    nbuf = np.empty(8, dtype=np.int32)
    elu1_row(out[i0:i1], x[i0:i1], cst[HALF] + cst[HALF], nbuf, cst, is32)


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True)
def _elu_back_rows(g, phi, dx, i0, i1):  # pragma: no cover - compiled
    """``dx[i] = g[i] * min(phi[i], 1)`` for ``i0 <= i < i1``."""
    for i in range(i0, i1):
        p = phi[i]
        dx[i] = g[i] * p if p < 1 else g[i]


class _EluPlusOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        xa = arr(x).reshape(-1)
        pa = output((xa.size,), xa.dtype)
        if xa.size:
            rows(_elu_rows, xa.size, xa, pa, constants(xa.dtype), xa.dtype == np.float32, item=_ITEM)
        phi = torch.from_numpy(pa).view(x.shape)
        ctx.save_for_backward(phi)
        return phi

    @staticmethod
    @first_order
    def backward(ctx, g: Tensor) -> Tensor:
        (phi,) = ctx.saved_tensors
        pa = phi.numpy().reshape(-1)
        da = output((pa.size,), pa.dtype)
        if pa.size:
            rows(_elu_back_rows, pa.size, arr(g.to(phi.dtype)).reshape(-1), pa, da, item=_ITEM)
        return torch.from_numpy(da).view(phi.shape)


def elu_plus_one(x: Tensor) -> Tensor:
    """``elu(x) + 1`` of a float32/float64 CPU tensor ``x (...)``, differentiable; same shape, values > 0.

    Raises:
        ValueError: ``x`` not a float32/float64 CPU tensor.
    """
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"elu_plus_one: x must be a float32 or float64 CPU tensor; got {x.dtype} on {x.device}")
    return _EluPlusOne.apply(x)
