"""Reformer's angular LSH and the sorted-chunk structure, shared by the module and its reference.

Hash of a vector ``x`` (``D``) in round ``r``: ``argmax([x R_r ; -x R_r])`` with a
random Gaussian ``R_r`` ``(D, n_buckets / 2)`` drawn from the module's ``seed``
(the same for every batch element and head). Each round sorts the positions by
``(bucket, position)``; padded keys count as absent: they sort after every real position and the
number of buckets is that of the real length. The sorted sequence is cut into chunks of
``bucket_size`` and a position may attend to the positions of its chunk and of
the previous chunk (none before chunk 0), minus itself, minus the future when
causal (by original positions), minus padded keys.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit import transforms
from attnkit.caching import outside_trace

__all__ = ["n_buckets", "rotations", "buckets", "sort_rounds", "sort_rounds_inverse", "unit", "real_lengths"]


def n_buckets(L: int, bucket_size: int) -> int:
    """Buckets for ``L`` positions: 1 when ``L <= bucket_size``, else ``ceil(L / bucket_size)`` rounded up to even
    (the hash ``argmax([xR; -xR])`` gives an even number of buckets)."""
    if L <= bucket_size:
        return 1
    nb = math.ceil(L / bucket_size)
    return nb + nb % 2


def rotations(seed: int, n_hashes: int, D: int, columns: int, *, dtype: torch.dtype,
              device: torch.device) -> Tensor:
    """``(n_hashes, D, columns)`` Gaussian rotations from ``torch.Generator().manual_seed(seed)``, float64.

    Drawn column after column, so the first ``c`` columns are the same for any ``columns >= c``: a
    sequence hashed with fewer buckets (a shorter one, or one with padded keys) uses a prefix of them.
    """
    with outside_trace():   # seeded draws of the shape: under torch.export a constant, not a generator op
        g = torch.Generator().manual_seed(seed)
        cols = [torch.randn(n_hashes, D, generator=g, dtype=torch.float64) for _ in range(max(1, columns))]
        return torch.stack(cols, -1).to(device=device, dtype=dtype)


def unit(k: Tensor) -> Tensor:
    """``k / max(‖k‖, 1e-12)`` along the last dim (zero vectors stay zero): the shared-QK keys.

    Half inputs are normalised in float32 (their squared norm can overflow float16) and the unit vectors
    cast back to the input dtype."""
    if k.dtype in (torch.float16, torch.bfloat16):
        return torch.nn.functional.normalize(k.float(), dim=-1, eps=1e-12).to(k.dtype)
    return torch.nn.functional.normalize(k, dim=-1, eps=1e-12)


def real_lengths(B: int, L: int, key_padding_mask: Tensor | None, device: torch.device) -> list[int]:
    """The real (non-padded) positions of each batch element (read from the mask: host ints; without one the
    lengths are ``L``, read from no tensor, so a ``torch.export`` trace stays free of data-dependent sizes)."""
    if key_padding_mask is None:
        return [L] * B
    return [int(n) for n in key_padding_mask.to(device).sum(-1).tolist()]


def buckets(x: Tensor, rot: Tensor, bucket_size: int, lengths: list[int]) -> Tensor:
    """int64 ``(B, H, n_hashes, L)`` buckets of ``x`` ``(B, H, L, D)`` (no gradient).

    Batch element ``b`` has ``n_buckets(lengths[b], bucket_size)`` buckets (its real length: padded keys
    count as absent) and uses the first half of that many columns of ``rot`` ``(n_hashes, D, C)``:
    ``argmax([xR; -xR])`` is the column of ``max(xR)`` when ``max(xR) >= -min(xR)``, else ``C + `` the
    column of ``min(xR)`` (labels in ``[0, 2C)``; one bucket: all 0). Half ``x`` is hashed in float32
    (``rot`` is float32 then: argmax ties and the projections are unreliable in half).
    """
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.detach().float()
    B, H, L, _ = x.shape
    C = rot.shape[-1]
    halves = [n_buckets(int(n), bucket_size) // 2 for n in lengths]
    groups: dict[int, list[int]] = {}
    for b, half in enumerate(halves):
        groups.setdefault(half, []).append(b)
    if len(groups) == 1 and halves[0] > 0:   # one bucket count for the whole batch (no padding): no zero fill
        return _labels(x.detach(), rot[..., :halves[0]], C)
    out = torch.zeros(B, H, rot.shape[0], L, dtype=torch.long, device=x.device)
    for half, rows in groups.items():
        if half == 0:
            continue
        sel = slice(rows[0], rows[0] + 1) if len(rows) == 1 else torch.tensor(rows, device=x.device)
        xb = x.detach()[sel] if len(rows) != B else x.detach()
        lab = _labels(xb, rot[..., :half], C)
        if len(rows) == B:
            out = lab
        else:
            out[sel] = lab
    return out


def _labels(x: Tensor, rot: Tensor, C: int) -> Tensor:
    """int64 ``(b, H, R, L)`` labels of ``x`` ``(b, H, L, D)`` with ``rot`` ``(R, D, half)`` (``half >= 1``).

    CPU with numba: :func:`.rounds.labels` (a block of rows rotated and reduced in cache, per round).
    Otherwise the rows' projections ``(b·H·L, R, half)`` by one product, reduced along their contiguous
    last dim.
    """
    b, H, L, D = x.shape
    R, _, half = rot.shape
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and _numba_ok():
        from .rounds import labels
        out = torch.empty(b, H, R, L, dtype=torch.long)
        return labels(x.contiguous(), rot.to(x.dtype), C, out)
    proj = torch.mm(x.reshape(b * H * L, D), rot.permute(1, 0, 2).reshape(D, R * half)).view(b, H, L, R, half)
    mx, amx = proj.max(-1)
    mn, amn = proj.min(-1)
    return torch.where(mx >= -mn, amx, C + amn).permute(0, 1, 3, 2)


def _numba_ok() -> bool:
    from ..engine import why_unavailable
    # under torch.func transforms and torch.export the tensors are wrappers without storage: the torch path
    return why_unavailable("numba", "cpu") is None and not transforms.plain_torch()


def sort_rounds(bk: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """``perm`` ``(B, H, R, L)``: each round's positions ordered by ``(bucket, position)``, padded keys last."""
    return sort_rounds_inverse(bk, key_padding_mask)[0]


def sort_rounds_inverse(bk: Tensor, key_padding_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(perm, inv)`` ``(B, H, R, L)``: :func:`sort_rounds` and its inverse (position -> sorted index).

    CPU with numba: a counting sort per row (the labels are small integers), which gives both at once;
    otherwise a stable ``argsort`` and a scatter of ``arange``.
    """
    if key_padding_mask is not None:
        last = bk.max() + 1 if bk.numel() else 0
        bk = torch.where(key_padding_mask.to(bk.device)[:, None, None, :], bk, last)
    if bk.device.type == "cpu" and bk.numel() and _numba_ok():
        from attnkit.numba_pool import run_ranges

        from ._numba import counting_sort
        B, H, R, L = bk.shape
        flat = bk.reshape(B * H * R, L).contiguous()
        perm, inv = torch.empty_like(flat, dtype=torch.int64), torch.empty_like(flat, dtype=torch.int64)
        run_ranges(counting_sort, B * H * R, flat.numpy(), int(flat.max()) + 1, perm.numpy(), inv.numpy())
        return perm.view(bk.shape), inv.view(bk.shape)
    perm = bk.argsort(dim=-1, stable=True)                               # ties (one bucket) by position
    inv = torch.empty_like(perm).scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device).expand_as(perm))
    return perm, inv
