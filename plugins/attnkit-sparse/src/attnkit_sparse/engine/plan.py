"""The block plan: what every kernel of the engine executes, computed once per (mask, shape, block size).

From a mask's :class:`attnkit.masks.BlockIndex` (``state`` ``(B', H', NQ, NK)``
of SKIP / PARTIAL / FULL tiles) the plan keeps, per query block, the key
blocks to visit and, per visited tile, whether it is FULL (no element mask)
or PARTIAL (an index into a *bank* of element masks). The bank holds bool
``(P, BQ, BK)`` tiles evaluated with the mask's own ``_keep`` on index
tensors of those tiles only, so the plan costs memory proportional to the
attended tiles, never an ``(L, S)`` tensor. The transposed (key-block-major)
index serves the backward pass: dK/dV of one key block is written by one
worker, which visits the query blocks that see it.

Tile entries (``kv_tile`` / ``q_tile``): ``-1`` = FULL, ``p >= 0`` = bank entry
``p``. Padding past a block's count holds index 0 and tile ``-2``. Tiles of
the ragged last block (lengths not multiples of the block size) are FULL or
PARTIAL like any other; kernels bound their loops by ``L`` and ``S``, and the
bank is False outside ``[0, L) x [0, S)``.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnkit.caching import cached, kept_tensors, outside_trace
from attnkit.errors import InvalidInputError
from attnkit.masks import FULL, PARTIAL, SKIP, Geometry, Mask
from attnkit.positions import Positions

__all__ = ["BlockPlan", "plan", "DEFAULT_BLOCK_SIZE", "check_block_size", "FULL_TILE", "PAD_TILE"]

#: ``(BQ, BK)`` used when ``block_size`` is None (measured on CPU: see docs/sparse-engine.md).
DEFAULT_BLOCK_SIZE = (64, 64)

#: tile entry of a FULL tile / of padding past a block's count
FULL_TILE, PAD_TILE = -1, -2

# element-mask entries evaluated at once when the bank is built
_BANK_CHUNK = 1 << 21

_PLANS: weakref.WeakKeyDictionary[Mask, dict[tuple[Any, ...], BlockPlan]] = weakref.WeakKeyDictionary()
_UNMASKED: dict[tuple[Any, ...], BlockPlan] = {}


def tl_dot_blocks(block_size: tuple[int, int]) -> bool:
    """True when both block sizes are powers of two >= 16: the tiles the triton backend's ``tl.dot`` takes."""
    return all(n >= 16 and not n & (n - 1) for n in block_size)


def check_block_size(block_size: Any) -> tuple[int, int]:
    """``(BQ, BK)`` from ``None`` (the default), an int or a pair of ints >= 1.

    Raises:
        InvalidInputError: anything else (the message names ``block_size`` and the value given).
    """
    if block_size is None:
        return DEFAULT_BLOCK_SIZE
    pair = (block_size, block_size) if isinstance(block_size, int) else block_size
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in pair)
    if not ok:
        raise InvalidInputError(f"block_size: expected None, an int >= 1 or a pair (BQ, BK) of ints >= 1, "
                                f"got {block_size!r}")
    return int(pair[0]), int(pair[1])


@dataclass(eq=False)
class BlockPlan:
    """The tiles a block-sparse kernel visits, for one (mask, B, H, L, S, block size, device).

    Index tensors have a leading ``(B', H')`` with B' in (1, B), H' in (1, H)
    (1: shared by every batch element / head: index with ``b % B'``).

    Attributes:
        L, S, block_size: ``(BQ, BK)``; NQ = ceil(L / BQ), NK = ceil(S / BK).
        kv_count: int32 ``(B', H', NQ)``: key blocks visited by each query block.
        kv_idx: int32 ``(B', H', NQ, CK)``: those key blocks, ascending (padded with 0).
        kv_tile: int32 ``(B', H', NQ, CK)``: -1 FULL, p >= 0 bank entry, -2 padding.
        q_count, q_idx, q_tile: the transposed index ``(B', H', NK)``, ``(B', H', NK, CQ)``:
            query blocks that see each key block, with the same tile entries.
        q_slot: int32 ``(B', H', NK, CQ)``: for each transposed entry, its position ``c`` in the
            query block's ``kv_idx`` row (so key-major and query-major kernels can share per-tile buffers).
        bank: bool ``(P, BQ, BK)``: element masks of the PARTIAL tiles (False outside L x S).
        span: int32 ``(P, BQ, 2)``: per query row of each bank entry, the first allowed column and
            one past the last (``(BK, 0)`` when none); kernels skip the columns outside it.
        tiles: attended (non-skipped) tiles over all ``(B', H')``.
        attended_pairs: allowed (query, key) pairs summed over ``(B', H')`` (None for a plan of content-based
            tiles built while ``torch.export`` traced: counting them would read the data).
    """

    L: int
    S: int
    block_size: tuple[int, int]
    kv_count: Tensor
    kv_idx: Tensor
    kv_tile: Tensor
    q_count: Tensor
    q_idx: Tensor
    q_tile: Tensor
    q_slot: Tensor
    bank: Tensor
    span: Tensor
    tiles: int
    attended_pairs: int | None
    _numpy: dict[str, Any] | None = field(default=None, repr=False)
    _int8_bank: Tensor | None = field(default=None, repr=False)
    _key_major: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    @property
    def num_blocks(self) -> tuple[int, int]:
        return math.ceil(self.L / self.block_size[0]), math.ceil(self.S / self.block_size[1])

    @property
    def index_dims(self) -> tuple[int, int]:
        """``(B', H')``."""
        return int(self.kv_count.shape[0]), int(self.kv_count.shape[1])

    def nbytes(self) -> int:
        """Bytes held by the plan's tensors (index and bank)."""
        ts = (self.kv_count, self.kv_idx, self.kv_tile, self.q_count, self.q_idx, self.q_tile, self.q_slot, self.bank,
              self.span)
        return sum(t.numel() * t.element_size() for t in ts)

    def numpy(self) -> dict[str, Any]:
        """The index and bank as contiguous NumPy arrays (CPU plans; cached)."""
        if self._numpy is None:
            names = ("kv_count", "kv_idx", "kv_tile", "q_count", "q_idx", "q_tile", "q_slot", "bank", "span")
            self._numpy = {n: getattr(self, n).contiguous().numpy() for n in names}
        return self._numpy

    def key_major_bank(self) -> Tensor:
        """The bank key-major, contiguous ``(P, BK, BQ)``: what the numba kernels read (their tiles' scores are
        key-major, and a mask read along them is applied without masked stores). Cached with the bank it was made
        from, so a reused plan transposes it once and a plan copied with another bank makes its own."""
        if self._key_major is None or self._key_major[0] is not self.bank:
            with outside_trace(self.bank), kept_tensors():
                self._key_major = (self.bank, self.bank.transpose(-1, -2).contiguous())
        return self._key_major[1]

    def int8_bank(self) -> Tensor:
        """The bank as contiguous int8 with at least one entry (what the triton kernels read; cached, so a
        reused plan does not convert its bank on every call)."""
        if self._int8_bank is None:
            bank = self.bank
            if bank.shape[0] == 0:
                bank = torch.ones(1, *bank.shape[1:], dtype=torch.bool, device=bank.device)
            self._int8_bank = bank.to(torch.int8).contiguous()
        return self._int8_bank

    def __repr__(self) -> str:
        nq, nk = self.num_blocks
        return (f"BlockPlan(L={self.L}, S={self.S}, block_size={self.block_size}, blocks={nq}x{nk}, "
                f"index_dims={self.index_dims}, tiles={self.tiles}, partial={self.bank.shape[0]}, "
                f"max_kv={self.kv_idx.shape[-1]})")


def _rows(b: Tensor, h: Tensor, row: Tensor, col: Tensor, tile: Tensor, dims: tuple[int, int, int],
          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Compact entries ``(b, h, row, col, tile)`` sorted by ``(b, h, row)`` (then ``col`` ascending) into per-row
    ``counts (B', H', R)``, ``idx``/``tiles (B', H', R, C)`` (padding 0 / -2) and each entry's slot ``c`` in its row.
    Works on the K attended entries only (a bincount and a scatter): no pass over the ``(NQ, NK)`` grid."""
    bp, hp, nrow = dims
    dev = row.device
    flat = (b * hp + h) * nrow + row
    counts = torch.bincount(flat, minlength=bp * hp * nrow)
    start = counts.cumsum(0) - counts
    slot = torch.arange(flat.shape[0], device=dev) - start[flat]
    width = max(1, int(counts.max()) if counts.numel() else 1)
    idx = torch.zeros(bp, hp, nrow, width, dtype=torch.int32, device=dev)
    tiles = torch.full((bp, hp, nrow, width), PAD_TILE, dtype=torch.int32, device=dev)
    idx[b, h, row, slot] = col.to(torch.int32)
    tiles[b, h, row, slot] = tile.to(torch.int32)
    return counts.view(bp, hp, nrow).to(torch.int32), idx, tiles, slot


def _bank(mask: Mask, geom: Geometry, parts: Tensor, bq: int, bk: int) -> Tensor:
    """Element masks ``(P, BQ, BK)`` of the tiles ``parts (P, 4)`` = (b', h', nq, nk), False outside L x S."""
    dev = geom.device
    P = parts.shape[0]
    out = torch.zeros(P, bq, bk, dtype=torch.bool, device=dev)
    per = max(1, _BANK_CHUNK // (bq * bk))
    aq = torch.arange(bq, device=dev).view(1, 1, bq, 1)
    ak = torch.arange(bk, device=dev).view(1, 1, 1, bk)
    for c0 in range(0, P, per):
        part = parts[c0:c0 + per]
        n = part.shape[0]
        b = part[:, 0].view(n, 1, 1, 1)
        h = part[:, 1].view(n, 1, 1, 1)
        qi = part[:, 2].view(n, 1, 1, 1) * bq + aq
        ki = part[:, 3].view(n, 1, 1, 1) * bk + ak
        valid = (qi < geom.L) & (ki < geom.S)
        keep = mask._keep(b, h, qi.clamp(max=geom.L - 1), ki.clamp(max=geom.S - 1), geom)
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            raise InvalidInputError(f"mask {mask!r}: its element mask must be a bool tensor, got {type(keep)}")
        out[c0:c0 + n] = (keep.expand(n, 1, bq, bk) & valid).view(n, bq, bk)
    return out


def _spans(bank: Tensor) -> Tensor:
    """int32 ``(P, BQ, 2)``: first allowed column and one past the last per row (``(BK, 0)`` for none)."""
    bk = bank.shape[-1]
    any_ = bank.any(-1)
    first = bank.to(torch.int8).argmax(-1)
    last = bk - bank.flip(-1).to(torch.int8).argmax(-1)
    lo = torch.where(any_, first, torch.full_like(first, bk))
    hi = torch.where(any_, last, torch.zeros_like(last))
    return torch.stack([lo, hi], -1).to(torch.int32).contiguous()


def _pairs(kv_idx: Tensor, kv_tile: Tensor, bank: Tensor, L: int, S: int, bq: int, bk: int) -> int:
    """Allowed (query, key) pairs: FULL tiles by their (possibly ragged) size plus, per PARTIAL tile, the
    True entries of its bank entry (entries may be shared by several tiles)."""
    nq = kv_idx.shape[-2]
    dev = kv_idx.device
    rows = torch.full((nq,), bq, dtype=torch.int64, device=dev)
    rows[-1] = L - (nq - 1) * bq
    cols = torch.minimum(S - kv_idx.long() * bk, torch.tensor(bk, device=dev))
    full = (kv_tile == FULL_TILE).long()
    per_entry = bank.flatten(1).sum(-1)
    partial = kv_tile[kv_tile >= 0].long()
    return int((full * cols * rows.view(nq, 1)).sum()) + int(per_entry[partial].sum())


def _shared_entries(parts: Tensor, nq: int, nk: int, bq: int, bk: int, L: int, S: int) -> tuple[Tensor, Tensor]:
    """For a mask that depends only on ``q_idx - kv_idx``: one representative per distinct element mask.

    A tile's mask is fixed by its offset ``qb·BQ - kb·BK`` and whether it is the ragged last query / key
    block. Returns ``(representatives (U,) into parts, entry (P,) in [0, U))``."""
    offset = parts[:, 2] * bq - parts[:, 3] * bk
    ragged_q = (parts[:, 2] == nq - 1) & (L % bq != 0)
    ragged_k = (parts[:, 3] == nk - 1) & (S % bk != 0)
    key = (offset - (offset.min() if offset.numel() else 0)) * 4 + ragged_q.long() * 2 + ragged_k.long()
    uniq, entry = torch.unique(key, return_inverse=True)
    rep = torch.empty(uniq.shape[0], dtype=torch.long, device=parts.device)
    rep.scatter_(0, entry, torch.arange(parts.shape[0], device=parts.device))  # any tile of a group will do
    return rep, entry


def _build(mask: Mask | None, B: int, H: int, L: int, S: int, bq: int, bk: int, device: torch.device,
           positions: Positions | None) -> BlockPlan:
    nq, nk = math.ceil(L / bq), math.ceil(S / bk)
    if mask is None:
        state = torch.full((1, 1, nq, nk), FULL, dtype=torch.int8, device=device)
        geom = None
    else:
        state = mask.block_index(B, H, L, S, block_size=(bq, bk), device=device, positions=positions).state
        geom = Geometry(B, H, L, S, device, positions)
    state = state.contiguous()
    bp, hp = int(state.shape[0]), int(state.shape[1])
    # one pass over the grid: the attended tiles, row-major (b', h', query block, key block ascending)
    b, h, qb, kb = (state != SKIP).nonzero(as_tuple=True)
    st = state[b, h, qb, kb]
    is_partial = st == PARTIAL
    parts = torch.stack([b, h, qb, kb], -1)[is_partial]
    tile = torch.full(st.shape, FULL_TILE, dtype=torch.int64, device=device)
    if parts.shape[0] and mask._shift_invariant(geom):  # type: ignore[union-attr]
        # causal / window bands: tiles at the same offset share one element mask (a handful of entries)
        rep, entry = _shared_entries(parts, nq, nk, bq, bk, L, S)
        tile[is_partial] = entry
        bank = _bank(mask, geom, parts[rep], bq, bk)  # type: ignore[arg-type]
    elif parts.shape[0]:
        tile[is_partial] = torch.arange(parts.shape[0], device=device)
        bank = _bank(mask, geom, parts, bq, bk)  # type: ignore[arg-type]
    else:
        bank = torch.zeros(0, bq, bk, dtype=torch.bool, device=device)
    kv_count, kv_idx, kv_tile, slot = _rows(b, h, qb, kb, tile, (bp, hp, nq))
    # the transposed index: the same entries ordered by (b', h', key block, query block)
    order = (((b * hp + h) * nk + kb) * nq + qb).argsort()
    bt, ht, kbt, qbt = b[order], h[order], kb[order], qb[order]
    q_count, q_idx, q_tile, tslot = _rows(bt, ht, kbt, qbt, tile[order], (bp, hp, nk))
    q_slot = torch.zeros(q_idx.shape, dtype=torch.int32, device=device)   # each entry's slot in its kv_idx row
    q_slot[bt, ht, kbt, tslot] = slot[order].to(torch.int32)
    return BlockPlan(L, S, (bq, bk), kv_count, kv_idx, kv_tile, q_count, q_idx, q_tile, q_slot, bank, _spans(bank),
                     tiles=int(kv_count.sum()), attended_pairs=_pairs(kv_idx, kv_tile, bank, L, S, bq, bk))


def plan(mask: Mask | None, B: int, H: int, L: int, S: int, *, block_size: Any = None,
         device: torch.device | str = "cpu", positions: Positions | None = None) -> BlockPlan:
    """The :class:`BlockPlan` of ``mask`` for this shape, computed once and cached (weakly on the mask).

    Args:
        mask: an :class:`attnkit.masks.Mask` (bool parts only) or None (every pair allowed).
        B, H, L, S: batch, heads, queries, keys.
        block_size: None (:data:`DEFAULT_BLOCK_SIZE`), ``BQ`` or ``(BQ, BK)``.
        device: where the plan lives (the device of q).
        positions: :class:`attnkit.positions.Positions` or None; a plan for explicit
            position tensors is not cached.

    Raises:
        InvalidInputError: a mask with an additive bias (the engine executes bool masks),
            a bad ``block_size``, a mask that does not fit the shape.
    """
    bq, bk = check_block_size(block_size)
    device = torch.device(device)
    if mask is not None and not isinstance(mask, Mask):
        raise InvalidInputError(f"mask: expected an attnkit.masks.Mask or None, got {type(mask).__name__}")
    if mask is not None and mask.has_bias:
        raise InvalidInputError(
            f"mask: the block-sparse engine executes bool masks (True = may attend); got {mask!r} with an "
            "additive float bias. Pass a bool attn_mask (or a mask without a float part); bool tensor masks "
            "are honoured")
    # a dynamic size of a torch.export trace: the plan follows the shape, so the trace specialises it (export then
    # reports the dimension as a constant: "Constraints violated")
    B, H, L, S = (int(n) if isinstance(n, torch.SymInt) else n for n in (B, H, L, S))
    for name, n in (("B", B), ("H", H), ("L", L), ("S", S)):
        if not isinstance(n, int) or n < 1:
            raise InvalidInputError(f"plan: {name} must be an int >= 1, got {n!r}")
    gkey = Geometry(B, H, L, S, device, positions).cache_key()
    key = None if gkey is None else (*gkey, bq, bk)
    # cached: never an inference tensor a later training call would meet; under torch.export, built on real
    # tensors (a constant of the exported program) unless the mask or positions come from the traced inputs; never
    # a torch.func transform's wrapper (they outlive it without storage)
    return cached(_UNMASKED if mask is None else _PLANS.setdefault(mask, {}), key,
                  lambda: _build(mask, B, H, L, S, bq, bk, device, positions), mask, positions, limit=16)
