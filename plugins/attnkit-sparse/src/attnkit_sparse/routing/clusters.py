"""Routing's balanced clusters, shared by the module and its reference.

Queries and keys are compared with the centroids in the unit-sphere space they
share (``q̂ = q/‖q‖``, ``k̂ = k/‖k‖``, unit centroids ``μ_c``). Each cluster
``c`` routes the ``w`` queries with the largest ``q̂·μ_c`` and the ``w`` keys
with the largest ``k̂·μ_c`` (top-k per centroid: balanced clusters), where
``w = max(1, ceil(n / num_clusters))`` for the ``n`` real (non-padded)
positions of the batch element; padded positions are never routed. A query
attends the keys of every cluster that routed it.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit import transforms
from attnkit.caching import kept_tensors

from ..base import spread_evenly

__all__ = ["route", "cluster_width", "unit"]


def unit(x: Tensor) -> Tensor:
    return torch.nn.functional.normalize(x, dim=-1, eps=1e-12)


def cluster_width(n: int, num_clusters: int) -> int:
    """Tokens each cluster routes for ``n`` real positions: ``max(1, ceil(n / num_clusters))``."""
    return max(1, math.ceil(n / num_clusters))


def _nearest(s: Tensor) -> Tensor:
    """int64 ``(B, H, L)``: the first cluster of largest score in ``s`` ``(B, H, C, L)`` (numba on CPU: a vertical
    pass along the contiguous L instead of a reduction over the strided C)."""
    B, H, C, L = s.shape
    if s.device.type == "cpu" and s.dtype in (torch.float32, torch.float64) and not transforms.plain_torch():
        from ..engine import why_unavailable
        if why_unavailable("numba", "cpu") is None:
            from attnkit.numba_pool import run_ranges

            from ._numba import argmax_clusters
            a = s.detach().contiguous().view(B * H, C, L).numpy()
            out = np.zeros((B * H, L), dtype=np.int64)
            run_ranges(argmax_clusters, B * H * -(-L // 512), a, out)
            return torch.from_numpy(out).view(B, H, L)
    return s.argmax(2)


def _numba_ok(x: Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or transforms.plain_torch():
        return False   # (under torch.func transforms and torch.export: tensors without storage, the torch path)
    from ..engine import why_unavailable
    return why_unavailable("numba", "cpu") is None


_BUFFERS = threading.local()


def _scores_buffer(B: int, H: int, C: int, L: int, dtype: torch.dtype) -> Tensor:
    """A ``(B, H, C, L)`` scores buffer reused by this thread's calls (64 MiB at 16K tokens, 128 clusters, 8 heads:
    a fresh one each call page-faulted it in again), released when a call needs another shape."""
    key = (B, H, C, L, dtype)
    if getattr(_BUFFERS, "key", None) != key:
        _BUFFERS.key, _BUFFERS.buf = None, None
        with kept_tensors():   # reused by later calls: never an inference tensor
            _BUFFERS.buf = torch.empty(B, H, C, L, dtype=dtype)
        _BUFFERS.key = key
    return _BUFFERS.buf


#: "auto" (the scores, nearest centroids and selection of one sequence in one kernel call, sequences handed to
#: threads, when the ``B·H`` sequences spread evenly over them: ``N % threads == 0`` or ``N >= 4·threads``), True
#: (always) or False (never: torch's product over all sequences, then the nearest-centroid and selection kernels)
PER_SEQUENCE: str | bool = "auto"


def _per_sequence(N: int) -> bool:
    if PER_SEQUENCE != "auto":
        return bool(PER_SEQUENCE)
    return spread_evenly(N)


def _writes_scores(widths: Any, W: int, L: int) -> bool:
    """Whether :func:`._numba.route_seq` writes some sequence's scores to its buffer: a batch element whose rows
    are too short for the sampled threshold (:func:`._numba.long_rows`)."""
    from ._numba import long_rows
    return not all(long_rows(min(int(wb), W), L, W) for wb in widths.tolist())


def _route_numba(q: Tensor, k: Tensor, centroids: Tensor, key_padding_mask: Tensor | None, widths: Tensor, W: int,
                 nearest: bool) -> tuple[Any, ...]:
    """:func:`route` on CPU (float32, float64): the scores ``μ_c·x`` of the raw rows (one product, no unit copy of
    q and k), each scaled by ``1/max(‖x‖, 1e-12)`` inside the kernel that picks each cluster's ``w`` largest in
    ascending position order (:func:`._numba.select_row`: a sampled threshold, one pass, no sort, no ``topk``
    over the whole row).

    Per sequence (:data:`PER_SEQUENCE`): one call of :func:`._numba.route_seq` computes a sequence's scores
    on register panels, its nearest centroids and its selection, so the sequence's 8 MiB of scores (16K
    positions, 128 clusters) are read back from the cache instead of memory. Otherwise torch's product over all
    sequences into a reused buffer, :func:`_nearest` and :func:`._numba.top_w_ascending`."""
    from attnkit.numba_pool import run_items, run_ranges

    from ._numba import route_seq, top_w_ascending
    B, H, L, D = q.shape
    C = centroids.shape[1]
    N = B * H
    if key_padding_mask is None:
        real = np.ones((1, L), dtype=np.bool_)
    else:
        real = key_padding_mask.to(torch.bool).contiguous().numpy()
    wd = widths.to(torch.int64).contiguous().numpy()
    out: list[Any] = []
    near = []
    per_seq = _per_sequence(N)
    for x in (q, k):
        xd = x.detach()
        if per_seq:
            xa = xd.contiguous().view(N, L, D).numpy()
            mu = centroids.to(xd.dtype).contiguous().numpy()
            # long rows never write their scores (route_seq keeps each tile's candidates while it is in cache):
            # the (B, H, C, L) buffer (64 MiB at 16K positions, 1 GiB at 64K) only when a row is short
            sa = (_scores_buffer(B, H, C, L, xd.dtype).view(N, C, L).numpy() if _writes_scores(wd, W, L)
                  else np.empty((N, C, 0), dtype=xa.dtype))
            inv_a = np.empty((N, L), dtype=xa.dtype)
            near_a = np.empty((N, L) if nearest else (0, 0), dtype=np.int64)
            idx, ok = np.zeros((N, C, W), dtype=np.int64), np.zeros((N, C, W), dtype=np.bool_)
            head, tail = (xa, mu, real, H, wd, W), (sa, inv_a, near_a, idx, ok)
            run_items(lambda n, a=head, b=tail: route_seq(*a, n, *b), N, team=True)
            if nearest:
                near.append(torch.from_numpy(near_a).view(B, H, L))
        else:
            s = _scores_buffer(B, H, C, L, xd.dtype)
            inv = torch.linalg.vector_norm(xd, dim=-1).clamp_(min=1e-12).reciprocal_()       # (B, H, L)
            s = torch.matmul(centroids.to(xd.dtype), xd.transpose(-1, -2), out=s)
            if nearest:
                near.append(_nearest(s))
            idx, ok = np.zeros((N, C, W), dtype=np.int64), np.zeros((N, C, W), dtype=np.bool_)
            run_ranges(top_w_ascending, N * -(-C // 8), s.contiguous().view(N, C, L).numpy(),
                       inv.contiguous().view(N, L).numpy(), real, H, wd, W, idx, ok)
        out += [torch.from_numpy(idx).view(B, H, C, W), torch.from_numpy(ok).view(B, H, C, W)]
    if nearest:
        return out[0], out[1], out[2], out[3], (near[0], near[1])
    return out[0], out[1], out[2], out[3]


def route(q: Tensor, k: Tensor, centroids: Tensor, key_padding_mask: Tensor | None, *,
          nearest: bool = False) -> tuple[Any, ...]:
    """The routed positions of each cluster.

    Args:
        q, k: ``(B, H, L, D)`` (float16/bfloat16 are routed in float32).
        centroids: ``(H', C, D)`` unit vectors, ``H'`` 1 or H.
        key_padding_mask: ``(B, L)`` bool (True = real) or None.
        nearest: also return each query's and key's nearest centroid (the k-means assignment of the
            EMA update), read off the same scores (no second product).

    Returns:
        ``(q_idx, q_ok, k_idx, k_ok)``: int64 ``(B, H, C, W)`` positions routed to each cluster, ascending
        (``W`` the widest batch element's width), and bool ``(B, H, C, W)`` which entries are used; with
        ``nearest`` a fifth entry ``(near_q, near_k)``, int64 ``(B, H, L)`` (arbitrary at padded positions).
    """
    B, H, L, _ = q.shape
    C = centroids.shape[1]
    # real lengths: host ints (without a mask read from no tensor, so a torch.export trace keeps static sizes)
    n = [L] * B if key_padding_mask is None else key_padding_mask.sum(-1).tolist()
    ws = [cluster_width(int(x), C) for x in n]
    widths = torch.tensor(ws, device=q.device)
    W = min(max(ws), L)
    out: list[Any] = []
    near = []
    if _numba_ok(q):
        return _route_numba(q, k, centroids, key_padding_mask, widths, W, nearest)
    for x in (q, k):
        xd = x.detach().float() if x.dtype in (torch.float16, torch.bfloat16) else x.detach()   # half: float32
        s = torch.einsum("bhld,hcd->bhcl", unit(xd), centroids.to(xd.dtype))             # (B, H, C, L)
        if nearest:
            near.append(_nearest(s))
        if key_padding_mask is not None:
            s = s.masked_fill(~key_padding_mask.to(q.device)[:, None, None, :], float("-inf"))
        val, idx = s.topk(W, dim=-1)                                                   # (B, H, C, W)
        ok = (torch.arange(W, device=q.device) < widths.view(B, 1, 1, 1)) & (val > float("-inf"))
        idx = torch.where(ok, idx, torch.full_like(idx, L))                            # unused: sort last
        idx, order = idx.sort(-1)
        ok = ok.gather(-1, order)
        out += [torch.where(ok, idx, torch.zeros_like(idx)), ok]
    if nearest:
        return out[0], out[1], out[2], out[3], (near[0], near[1])
    return out[0], out[1], out[2], out[3]
