"""The ``flex`` backend: PyTorch FlexAttention executing the engine's plan.

The ``BlockMask`` is built from the plan's own block index
(``BlockMask.from_kv_blocks``: PARTIAL tiles as ``kv_num_blocks/kv_indices``,
FULL tiles as ``full_kv_num_blocks/full_kv_indices``), and its ``mask_mod``
reads the plan's element-mask bank (tile -> bank entry, then the element),
so any mask, a user's mask function included, lowers to plain indexing, and
FlexAttention visits exactly the tiles the other backends visit, with the
plan's block size. It is cached on the plan. ``flex_attention`` is compiled
once per process (``torch.compile``) and reused; set :data:`COMPILE` to False
to run it eagerly (tests; eager FlexAttention materialises the scores).

CUDA: forward and backward. CPU: forward only (PyTorch has no CPU backward of
FlexAttention); :func:`attnkit_sparse.engine.attend` refuses it when a gradient
is needed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit.caching import kept_tensors
from attnkit.masks import Mask
from attnkit.positions import Positions

from .plan import BlockPlan

#: compile ``flex_attention`` (False: eager, for tests and debugging)
COMPILE = True

_COMPILED: dict[str, Any] = {}


def _flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention
    if not COMPILE:
        return flex_attention
    fn = _COMPILED.get("flex")
    if fn is None:
        fn = _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return fn


def _dense_blocks(counts: Tensor, idx: Tensor, tiles: Tensor, full: bool, nk: int) -> tuple[Tensor, Tensor]:
    """FlexAttention's ``(num_blocks (B', H', NQ), indices (B', H', NQ, NK))`` for FULL (or PARTIAL) tiles."""
    sel = (tiles == -1) if full else (tiles >= 0)
    n = sel.sum(-1, dtype=torch.int32)
    key = torch.where(sel, idx.long(), torch.full_like(idx, nk, dtype=torch.long))
    order = key.sort(-1).values.clamp(max=nk - 1).to(torch.int32)
    width = order.shape[-1]
    if width < nk:  # FlexAttention expects NK columns
        order = torch.nn.functional.pad(order, (0, nk - width))
    return n.contiguous(), order.contiguous()


def block_mask(mask: Mask | None, plan: BlockPlan, B: int, H: int, device: torch.device,
               positions: Positions | None) -> Any:
    """The ``BlockMask`` of ``plan`` (cached on the plan)."""
    cached = plan.__dict__.get("_flex_block_mask")
    if cached is not None:
        return cached
    with kept_tensors():   # cached: never an inference tensor a later training call would meet
        bm = _block_mask(plan, B, H, device)
    plan.__dict__["_flex_block_mask"] = bm
    return bm


def _block_mask(plan: BlockPlan, B: int, H: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import BlockMask
    nq, nk = plan.num_blocks
    L, S = plan.L, plan.S
    counts, idx, tiles = plan.kv_count, plan.kv_idx, plan.kv_tile
    if plan.index_dims != (1, 1):  # FlexAttention broadcasts (1, 1) only: expand to (B, H)
        counts = counts.expand(B, H, *counts.shape[2:])
        idx, tiles = (t.expand(B, H, *t.shape[2:]) for t in (idx, tiles))
    p_num, p_idx = _dense_blocks(counts, idx, tiles, False, nk)
    f_num, f_idx = _dense_blocks(counts, idx, tiles, True, nk)
    # mask_mod reads the plan's own element masks: tile -> bank entry (FULL: an all-True entry, SKIP: all-False);
    # pure indexing into captured tensors, which compiled FlexAttention lowers for any mask (functions too)
    bq, bk = plan.block_size
    P = plan.bank.shape[0]
    bank = torch.cat([plan.bank, torch.ones(1, bq, bk, dtype=torch.bool, device=device),
                      torch.zeros(1, bq, bk, dtype=torch.bool, device=device)])
    b_dim, h_dim = plan.index_dims
    tile_of = torch.full((b_dim, h_dim, nq, nk), P + 1, dtype=torch.int32, device=device)
    valid = torch.arange(plan.kv_idx.shape[-1], device=device) < plan.kv_count.unsqueeze(-1)
    entry = torch.where(plan.kv_tile >= 0, plan.kv_tile, torch.full_like(plan.kv_tile, P))
    bi, hi, qi, ci = valid.nonzero(as_tuple=True)
    tile_of[bi, hi, qi, plan.kv_idx[bi, hi, qi, ci].long()] = entry[bi, hi, qi, ci]

    def mask_mod(b, h, q_idx, kv_idx):
        bb = b if b_dim > 1 else b * 0
        hh = h if h_dim > 1 else h * 0
        t = tile_of[bb, hh, q_idx // bq, kv_idx // bk]
        return bank[t, q_idx % bq, kv_idx % bk] & (q_idx < L) & (kv_idx < S)
    return BlockMask.from_kv_blocks(p_num, p_idx, f_num, f_idx, BLOCK_SIZE=plan.block_size, mask_mod=mask_mod,
                                     seq_lengths=(L, S))


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, plan: BlockPlan, scale: float,
           positions: Positions | None) -> Tensor:
    """Block-sparse attention with FlexAttention on the plan's block mask.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``.
        mask, plan, positions: the mask, its plan and positions (for ``mask_mod``).
        scale: multiplier of ``q · k``.

    Returns:
        ``(B, H, L, E)``; rows with no allowed key are 0.
    """
    B, H = q.shape[:2]
    bm = block_mask(mask, plan, B, H, q.device, positions)
    options = kernel_options(plan, q.device)
    if options:
        return _flex()(q, k, v, block_mask=bm, scale=scale, kernel_options=options)
    return _flex()(q, k, v, block_mask=bm, scale=scale)


def kernel_options(plan: BlockPlan, device: torch.device) -> dict[str, int] | None:
    """FlexAttention's kernel tiles for a plan whose blocks are not multiples of 128 (CUDA), else None.

    Compiled FlexAttention on CUDA needs its kernel tiles (``BLOCK_M``, ``BLOCK_N`` in the forward,
    ``BLOCK_M1`` ... ``BLOCK_N2`` in the backward) to divide the block mask's block size; its default tiles
    (up to 128) do not divide 64 (seen on an H100, torch 2.11: "Q and KV block size must be divisible by
    BLOCK_M and BLOCK_N"). Then every tile of both passes (``fwd_``/``bwd_`` prefixed, so each pass gets
    only its own) is set to the largest power of two dividing both block sizes, at most 64. On the H100
    the forward ran so at 64, but the backward did not: torch 2.11 drops its backward configurations whose
    tiles do not divide the blocks before it reads these options ("NoValidChoicesError"). So
    :func:`attnkit_sparse.engine.attend` gives the ``flex`` backend FlexAttention's own 128 on CUDA when no
    block size is asked for, and refuses a gradient through smaller blocks with an error naming ``triton``.
    """
    bq, bk = plan.block_size
    if device.type != "cuda" or (bq % 128 == 0 and bk % 128 == 0):
        return None
    g = math.gcd(bq, bk)
    t = min(g & -g, 64)
    return {"fwd_BLOCK_M": t, "fwd_BLOCK_N": t,
            "bwd_BLOCK_M1": t, "bwd_BLOCK_N1": t, "bwd_BLOCK_M2": t, "bwd_BLOCK_N2": t}
