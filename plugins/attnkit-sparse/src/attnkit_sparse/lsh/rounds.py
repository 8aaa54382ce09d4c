"""The CPU hashing of :class:`~attnkit_sparse.lsh.attention.LSHAttention`: :func:`labels` on numba kernels.

float32 and float64 CPU tensors.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["labels"]


def labels(x: Tensor, rot: Tensor, C: int, out: Tensor, *, rows_per_item: int = 2048) -> Tensor:
    """``argmax([x R; -x R])`` labels of ``x`` ``(B, H, L, D)`` into ``out`` int64 ``(B, H, R, L)``, with ``rot``
    ``(R, D, half)`` and labels in ``[0, 2C)`` (see :func:`.hashing.buckets`).

    :func:`._numba.hash_rows` rotates a block of rows and one round at a time, transposed, and reduces them at
    once (first max and first min of each row, a row per vector lane), so the projection (``L·R·L/(2·bucket)``
    floats, quadratic in L) is never written out; the rows are handed to the threads ``rows_per_item`` at a time
    (:func:`attnkit.numba_pool.run_items`: a thread slowed by another process takes fewer).
    """
    from attnkit.numba_pool import run_items

    from ._numba import hash_rows

    B, H, L, D = x.shape
    flat = x.detach().reshape(B * H * L, D).contiguous().numpy()
    rmat = rot.detach().contiguous().numpy()
    o = out.view(B * H, rot.shape[0], L).numpy()
    n = B * H * L
    step = max(1, int(rows_per_item))
    run_items(lambda i: hash_rows(flat, rmat, C, L, o, i * step, min(n, (i + 1) * step)), -(-n // step), team=True)
    return out
