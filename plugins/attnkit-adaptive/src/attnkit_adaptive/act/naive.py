"""The plain reference of the ``act`` block: an explicit loop over steps and, inside, over positions.

Every step applies the block's own inner block to the whole state (the
positions attend to each other), then decides halting position by position
with scalar Python logic (Graves 2016, Algorithm "ACT"): a running position
adds ``p`` to its sum unless that would pass ``1 - epsilon`` (or the step is
the last), in which case it halts with the remainder ``R = 1 - sum``. The
output is ``sum_t w_t · state_t`` per position. Tests only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def reference(block: Any, x: Tensor, **kw: Any) -> tuple[Tensor, list[list[list[Tensor]]], Tensor, Tensor]:
    """Run ``block`` (an :class:`~attnkit_adaptive.act.module.ACTBlock`) the plain way.

    Args:
        block: the built block (its inner block, halting unit, max_steps, epsilon, coordinates).
        x: ``(B, L, dim)``.
        **kw: masks and positions for the inner block.

    Returns:
        ``(out (B, L, dim), weights[b][i] = [w_1, ..., w_N] (scalar tensors), N (B, L), R (B, L))``.
    """
    B, L, _ = x.shape
    threshold = 1.0 - block.epsilon
    h = x
    total = [[0.0 * x.sum() for _ in range(L)] for _ in range(B)]
    halted = [[False] * L for _ in range(B)]
    weights: list[list[list[Tensor]]] = [[[] for _ in range(L)] for _ in range(B)]
    outs = [[torch.zeros_like(x[0, 0]) for _ in range(L)] for _ in range(B)]
    remainder = [[0.0 * x.sum() for _ in range(L)] for _ in range(B)]
    for t in range(block.max_steps):
        h = h + block.coordinates(L, t, x)
        p = torch.sigmoid(block.halting(h))[..., 0]
        new = block.inner(h, **kw)
        last = t == block.max_steps - 1
        for b in range(B):
            for i in range(L):
                if halted[b][i]:
                    continue
                if last or float((total[b][i] + p[b, i]).detach()) > threshold:
                    w = 1.0 - total[b][i]
                    remainder[b][i] = w
                    halted[b][i] = True
                else:
                    w = p[b, i]
                    total[b][i] = total[b][i] + p[b, i]
                weights[b][i].append(w)
                outs[b][i] = outs[b][i] + w * new[b, i]
        h = new
    out = torch.stack([torch.stack(row) for row in outs])
    n = torch.tensor([[len(weights[b][i]) for i in range(L)] for b in range(B)], dtype=x.dtype)
    r = torch.stack([torch.stack(row) for row in remainder])
    return out, weights, n, r
