"""Plans from explicit tiles: content-based sparsity (LSH buckets, k-means clusters, sorted blocks) on the engine.

Position-based patterns describe their tiles with a mask object
(:func:`attnkit_sparse.engine.plan.plan`). Content-based mechanisms decide
the attended pairs from the data on every call: they reorder the sequence
(sort by bucket or cluster, gather sorted blocks) so that the attended pairs
of the reordered sequence fall in a few tiles per query block, and give the
engine those tiles and their element masks directly::

    p = explicit_plan(kv_idx, bank, L, S)      # kv_idx (B', H', NQ, C), bank (B', H', NQ, C, BQ, BK)
    out, lse = attend_plan(q, k, v, p, scale=scale, backend="numba", return_lse=True)

Building the plan costs time and memory proportional to the given tiles
(``C·BQ·BK`` bools per query block), never ``(L, S)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit.errors import InvalidInputError

from .plan import BlockPlan, _rows, _spans

__all__ = ["explicit_plan", "band_plan"]


def explicit_plan(kv_idx: Tensor, bank: Tensor, L: int, S: int) -> BlockPlan:
    """A :class:`~attnkit_sparse.engine.plan.BlockPlan` from the key blocks of each query block and their masks.

    Args:
        kv_idx: int ``(B', H', NQ, C)``: the key blocks query block ``n`` visits, strictly ascending
            along ``C`` among the valid entries; ``-1`` marks an unused slot (anywhere in the row).
            ``B'`` is 1 or B, ``H'`` 1 or H (1: shared by every batch element / head).
        bank: bool ``(B', H', NQ, C, BQ, BK)``: the element mask of each visited tile (True = may
            attend). Entries past ``L`` (rows) or ``S`` (columns) are ignored (False).
        L, S: query and key lengths; ``NQ = ceil(L / BQ)`` and every block index ``< ceil(S / BK)``.

    Returns:
        The plan; every visited tile is PARTIAL with its own bank entry.

    Raises:
        InvalidInputError: shapes that do not agree, block indices out of range or not ascending.
    """
    if kv_idx.dim() != 4 or bank.dim() != 6 or bank.shape[:4] != kv_idx.shape or bank.dtype != torch.bool:
        raise InvalidInputError(f"explicit_plan: expected kv_idx (B', H', NQ, C) and a bool bank (B', H', NQ, C, "
                                f"BQ, BK), got kv_idx {tuple(kv_idx.shape)}, bank {tuple(bank.shape)} {bank.dtype}")
    bp, hp, nq, _ = kv_idx.shape
    bq, bk = int(bank.shape[-2]), int(bank.shape[-1])
    nk = math.ceil(S / bk)
    if nq != math.ceil(L / bq):
        raise InvalidInputError(f"explicit_plan: {nq} query blocks of {bq} do not cover L={L}")
    dev = kv_idx.device
    kv_idx = kv_idx.long()
    valid = kv_idx >= 0
    if bool((kv_idx >= nk).any()):
        raise InvalidInputError(f"explicit_plan: a key block index >= {nk} (S={S}, BK={bk})")
    big = torch.where(valid, kv_idx, torch.full_like(kv_idx, nk))
    if kv_idx.shape[-1] > 1:
        srt = big.sort(-1).values
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] < nk)
        if bool(dup.any()):
            raise InvalidInputError("explicit_plan: a query block lists the same key block twice")
        order = big.argsort(dim=-1, stable=True)
        kv_idx = kv_idx.gather(-1, order)
        valid = valid.gather(-1, order)
        bank = bank.gather(3, order[..., None, None].expand(bank.shape))
    b, h, qb, c = valid.nonzero(as_tuple=True)           # row-major: (b', h', query block, key block ascending)
    kb = kv_idx[b, h, qb, c]
    P = int(b.shape[0])
    tile = torch.arange(P, device=dev)
    rows = qb.view(P, 1, 1) * bq + torch.arange(bq, device=dev).view(1, bq, 1)
    cols = kb.view(P, 1, 1) * bk + torch.arange(bk, device=dev).view(1, 1, bk)
    flat = bank[b, h, qb, c] & (rows < L) & (cols < S)   # (P, BQ, BK)
    kv_count, kv_i, kv_tile, slot = _rows(b, h, qb, kb, tile, (bp, hp, nq))
    order = (((b * hp + h) * nk + kb) * nq + qb).argsort()
    bt, ht, kbt, qbt = b[order], h[order], kb[order], qb[order]
    q_count, q_idx, q_tile, tslot = _rows(bt, ht, kbt, qbt, tile[order], (bp, hp, nk))
    q_slot = torch.zeros(q_idx.shape, dtype=torch.int32, device=dev)
    q_slot[bt, ht, kbt, tslot] = slot[order].to(torch.int32)
    return BlockPlan(L, S, (bq, bk), kv_count, kv_i, kv_tile, q_count, q_idx, q_tile, q_slot, flat.contiguous(),
                     _spans(flat), tiles=P, attended_pairs=_count(flat))


def _count(flat: Tensor) -> int | None:
    """The True entries of a bank built from the data; None while torch.export traces (a count read from the data
    would be a data-dependent value in the program, and nothing in the program needs it)."""
    return None if torch.compiler.is_exporting() else int(flat.sum())


def band_plan(bank: Tensor, L: int, *, span: Tensor | None = None, pairs: int | None = None) -> BlockPlan:
    """The plan of "query block ``n`` visits key blocks ``n - 1`` and ``n``" (self-attention, ``L = S``).

    The structure of sorted-chunk attention (Reformer's chunk and previous
    chunk), built analytically: no pass over the bank besides its spans.

    Args:
        bank: bool ``(B', H', NQ, 2, BS, BS)``: element masks, slot 0 = the previous block
            (ignored for block 0), slot 1 = the block itself; False past ``L``.
        L: the sequence length (``NQ = ceil(L / BS)``).
        span: optional int32 ``(B', H', NQ, 2, BS, 2)`` spans of the bank rows (first allowed column,
            one past the last; ``(BS, 0)`` when none), when the caller computed them with the bank.
        pairs: optional count of True entries of the bank (the plan's ``attended_pairs``).

    Returns:
        A :class:`BlockPlan` whose bank is ``bank`` viewed as ``(B'·H'·NQ·2, BS, BS)`` (no copy).

    Raises:
        InvalidInputError: a bank of another shape.
    """
    if bank.dim() != 6 or bank.shape[3] != 2 or bank.shape[-1] != bank.shape[-2] or bank.dtype != torch.bool:
        raise InvalidInputError(f"band_plan: expected a bool bank (B', H', NQ, 2, BS, BS), got "
                                f"{tuple(bank.shape)} {bank.dtype}")
    bp, hp, nq, _, bs, _ = bank.shape
    if nq != math.ceil(L / bs):
        raise InvalidInputError(f"band_plan: {nq} blocks of {bs} do not cover L={L}")
    dev = bank.device
    i32 = dict(dtype=torch.int32, device=dev)
    n = torch.arange(nq, **i32)
    base = (torch.arange(bp * hp, **i32) * (nq * 2)).view(bp, hp, 1, 1)
    pad = torch.full((nq,), -2, **i32)
    # query-major rows: [n - 1 (slot 0), n (slot 1)]; block 0: [0 (its slot 1), padding]
    kv_idx = torch.stack([(n - 1).clamp(min=0), torch.where(n > 0, n, torch.zeros_like(n))], -1)
    rel = torch.stack([n * 2, n * 2 + 1], -1)
    rel[0] = torch.tensor([1, 0], **i32)
    kv_tile = (base + rel.view(1, 1, nq, 2)).contiguous()
    kv_tile[:, :, 0, 1] = -2
    kv_count = torch.where(n > 0, 2, 1).to(torch.int32).view(1, 1, nq).expand(bp, hp, nq).contiguous()
    # key-major rows: key block m is seen by query block m (its slot 1) and m + 1 (slot 0)
    q_idx = torch.stack([n, (n + 1).clamp(max=nq - 1)], -1)
    last = n == nq - 1
    q_rel = torch.stack([n * 2 + 1, (n + 1) * 2], -1)
    q_slot = torch.stack([torch.where(n > 0, 1, 0).to(torch.int32), torch.zeros_like(n)], -1)
    q_tile = (base + q_rel.view(1, 1, nq, 2)).contiguous()
    q_tile[:, :, :, 1] = torch.where(last.view(1, 1, nq), pad.view(1, 1, nq), q_tile[:, :, :, 1])
    q_count = torch.where(last, 1, 2).to(torch.int32).view(1, 1, nq).expand(bp, hp, nq).contiguous()
    q_idx = torch.where(last.view(nq, 1) & (torch.arange(2, device=dev) == 1), torch.zeros_like(q_idx), q_idx)
    flat = bank.view(bp * hp * nq * 2, bs, bs)
    sp = _spans(flat) if span is None else span.reshape(bp * hp * nq * 2, bs, 2)
    return BlockPlan(L, L, (bs, bs), kv_count, kv_idx.view(1, 1, nq, 2).expand(bp, hp, nq, 2).contiguous(), kv_tile,
                     q_count, q_idx.view(1, 1, nq, 2).expand(bp, hp, nq, 2).contiguous(), q_tile,
                     q_slot.view(1, 1, nq, 2).expand(bp, hp, nq, 2).contiguous(), flat, sp,
                     tiles=bp * hp * (2 * nq - 1),
                     attended_pairs=int(pairs) if pairs is not None else _count(flat))
