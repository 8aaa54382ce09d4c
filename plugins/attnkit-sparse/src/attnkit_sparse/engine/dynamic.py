"""Banded attention for a length ``torch.export`` traces as dynamic: no block plan, one program for every length.

A block plan is built from the length (Python integers), so a program holding one fixes the length. A
pattern whose allowed pairs lie in a position band, ``lo <= q - k <= hi`` with both bounds finite, apart from
fixed global key and query positions (:meth:`attnkit.masks.Mask._cover`: sliding windows, dilated bands, block
bands, global tokens), needs no plan: split the sequence into ``N`` chunks of ``C`` positions (``N`` from
:func:`attnkit.transforms.chunk_count`, a size of its own), give each query chunk the ``K`` key chunks the band
can reach (``K`` depends on the band and ``C`` only) and evaluate the whole mask at those pairs (:func:`_keep`).
Then either the engine's numba kernels run over a block index built from those pairs with tensor operators
(:func:`band_index`: eager's kernels, forward and backward), or the masked softmax runs over the gathered
chunks with torch operators (:func:`attend_band`: work and memory ``O(L·K·C·(D + E))``). Global keys and
queries are attended apart and merged (:func:`attend_dynamic`). The result is the engine's (same allowed
pairs, rows with no allowed key give 0); only rounding differs from the plan's tiles.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.masks import Geometry, Mask
from attnkit.transforms import chunk_count

from ..patterns._atoms import members

#: positions per chunk when the band is narrow (a wider band takes chunks near its width)
MIN_CHUNK = 16
MAX_CHUNK = 128


#: global positions (keys and queries) a dynamic program attends apart at most; more fix the length
MAX_GLOBALS = 1024

Cover = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def _finite(x: float) -> bool:
    return math.isfinite(x) and abs(x) < 2 ** 40


def cover_of(mask: Mask | None) -> Cover | None:
    """``(lo, hi, keys, queries)``: every allowed pair of ``mask`` has ``lo <= q - k <= hi`` or its key at one
    of ``keys`` or its query at one of ``queries`` (sorted positions; ``lo > hi`` for no band), or None when
    :meth:`attnkit.masks.Mask._cover` knows no such bound (or the bound has more than :data:`MAX_GLOBALS`
    positions)."""
    cover = None if mask is None else mask._cover()
    if cover is None:
        return None
    lo, hi, keys, queries = cover
    if len(keys) + len(queries) > MAX_GLOBALS:
        return None
    if lo > hi:
        return (1, 0, tuple(sorted(keys)), tuple(sorted(queries))) if keys or queries else None
    if not (_finite(lo) and _finite(hi)):
        return None
    return int(math.floor(lo)), int(math.ceil(hi)), tuple(sorted(keys)), tuple(sorted(queries))


def band_of(mask: Mask | None) -> tuple[int, int] | None:
    """``(lo, hi)``, finite bounds of ``q - k`` over the allowed pairs of ``mask``, or None."""
    reach = None if mask is None else mask._reach()
    if reach is None or not all(math.isfinite(r) and abs(r) < 2 ** 40 for r in reach):
        return None
    return int(math.floor(reach[0])), int(math.ceil(reach[1]))


def _keep(q: Tensor, mask: Mask, band: tuple[int, int], C: int, drop_keys: Tensor | None = None,
          ) -> tuple[Tensor, int, int, int, int, int]:
    """The whole mask at the pairs each query chunk of ``C`` positions can reach within ``band``: bool
    ``(B', H', N, C, K·C)`` (``B'``, ``H'``: 1 or ``B``, ``H``, as the mask depends on them), with ``N``, ``first``
    (the offset of a chunk's first reachable key chunk), ``left``, ``right`` (key chunks padded before and after)
    and ``K``. False outside the sequence and the band, and at keys in ``drop_keys`` (sorted positions).

    The ``&``-ed parts that depend on the positions only through ``q - k`` (:meth:`attnkit.masks.Mask._relative`:
    windows, causal, dilated bands) are the same in every chunk: evaluated once on a ``(C, K·C)`` grid; the
    others (key padding, functions) at every pair."""
    B, H, L, _ = q.shape
    lo, hi = band
    N = chunk_count(L, C)
    first, last = (-hi) // C, (C - 1 - lo) // C   # key chunks i + first .. i + last can hold an allowed key
    left, right = max(0, -first), max(0, last)
    K = last - first + 1
    dev = q.device
    rows = torch.arange(C, device=dev)
    cols = torch.arange(first * C, (last + 1) * C, device=dev)          # key offsets from a chunk's start
    start = torch.arange(N, device=dev).mul(C).view(N, 1)                # each chunk's first position
    qpos, kpos = start + rows, start + cols                              # (N, C), (N, K·C)
    kin = (kpos >= 0) & (kpos < L)
    if drop_keys is not None:
        kin = kin & ~members(drop_keys, kpos)[0]
    geom = Geometry(B, H, L, L, dev, None)
    b = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1, 1)
    d = rows.view(C, 1) - cols.view(1, K * C)                            # q - k, the same in every chunk
    tile = ((d >= lo) & (d <= hi)).view(1, 1, 1, C, K * C)
    parts = mask.conjuncts()
    # the relative parts on a grid of positions >= 0, in a geometry of its own that holds them (a part may read
    # a position table of the geometry's length)
    shift = -first * C
    grid = Geometry(B, H, (K + 1) * C, (K + 1) * C, dev, None)
    for p in (p for p in parts if p._relative()):
        tile = tile & p._keep(b, h, (rows + shift).view(1, 1, 1, C, 1), (cols + shift).view(1, 1, 1, 1, K * C), grid)
    keep = tile & (qpos < L).view(1, 1, N, C, 1) & kin.view(1, 1, N, 1, K * C)
    qi, ki = qpos.view(1, 1, N, C, 1), kpos.view(1, 1, N, 1, K * C)
    for p in (p for p in parts if not p._relative()):
        # indices outside the sequence clamped for the evaluation (a mask may index a table with them): those
        # pairs are masked above whatever the part says
        keep = keep & p._keep(b, h, qi.clamp(0, L - 1), ki.clamp(0, L - 1), geom)
    return keep, N, first, left, right, K


def chunk_size(band: tuple[int, int]) -> int:
    """The chunk of :func:`attend_band`: a power of two near the band's width, 16 to 128."""
    lo, hi = band
    return max(MIN_CHUNK, min(MAX_CHUNK, 1 << max(0, hi - lo).bit_length()))


def attend_band(q: Tensor, k: Tensor, v: Tensor, mask: Mask, band: tuple[int, int], scale: float, *,
                drop_keys: Tensor | None = None, return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Masked softmax attention of ``q (B, H, L, D)`` over ``k, v (B, H, L, *)`` (self-attention: one length)
    where every allowed pair has ``lo <= q - k <= hi`` (``band``); ``mask`` is evaluated at each gathered pair,
    keys at ``drop_keys`` (sorted positions, or None) are left out.
    Returns ``(B, H, L, E)``; a query with no allowed key gives 0. With ``return_lse`` also the log-sum-exp
    ``(B, H, L)`` of each row's allowed scaled scores (``-inf`` for none)."""
    B, H, L, _ = q.shape
    E = v.shape[-1]
    lo, hi = band
    if lo > hi:                              # an empty band allows nothing
        out = q.new_zeros(B, H, L, E) + 0 * v.sum()
        return (out, q.new_full((B, H, L), -math.inf)) if return_lse else out
    C = chunk_size(band)
    keep, N, first, left, right, K = _keep(q, mask, band, C, drop_keys)

    def padded(x: Tensor, before: int, after: int) -> Tensor:
        return F.pad(x, (0, 0, before * C, N * C - L + after * C))

    qc = padded(q * scale, 0, 0).reshape(B, H, -1, C, q.shape[-1])      # (B, H, N, C, D), scaled once
    kc = padded(k, left, right).reshape(B, H, -1, C, k.shape[-1])       # (B, H, left + N + right, C, D)
    vc = padded(v, left, right).reshape(B, H, -1, C, E)
    # the K key chunks of query chunk i are chunks i + first .. i + first + K - 1: one slice of whole chunks per
    # offset (contiguous operands for the products, no gathered copies of k and v)
    offsets = [left + o for o in range(first, first + K)]
    # masked scores at the dtype's lowest finite value, not -inf: a row with no allowed key then has a finite
    # (uniform) softmax and finite gradients, and its output is set to 0 below
    s = torch.cat([qc @ kc[:, :, o:o + N].transpose(-1, -2) for o in offsets], dim=-1)   # (B, H, N, C, K·C)
    p = torch.softmax(s.masked_fill_(~keep, torch.finfo(q.dtype).min), dim=-1)
    out = p[..., :C] @ vc[:, :, offsets[0]:offsets[0] + N]
    for n, o in enumerate(offsets[1:], 1):
        out = out + p[..., n * C:(n + 1) * C] @ vc[:, :, o:o + N]       # (B, H, N, C, E)
    some = keep.any(-1, keepdim=True)
    out = out.masked_fill(~some, 0.0).reshape(B, H, -1, E)[:, :, :L]
    if not return_lse:
        return out
    lse = torch.where(some[..., 0], torch.logsumexp(s, -1), -math.inf)
    return out, lse.reshape(B, H, -1)[:, :, :L]


def band_index(q: Tensor, mask: Mask, band: tuple[int, int], C: int, drop_keys: Tensor | None = None,
               ) -> tuple[Tensor, ...]:
    """The block index of the engine's kernels for a banded mask, built from tensors without the length as a
    Python integer: query block ``i`` (``C`` positions, the blocks ``(C, C)``) visits those of key blocks
    ``i + first .. i + first + K - 1`` that hold an allowed pair (the mask evaluated at the tile's pairs,
    :func:`_keep`; a tile with none, outside the sequence or masked whole, is left out of the lists), each FULL
    or a bank entry of its own. Returns ``(kv_count, kv_idx, kv_tile, q_count, q_idx, q_tile, q_slot, bank
    (key-major, (P, C, C)), span)``, the tensors :class:`~.plan.BlockPlan` documents, with ``P = B'·H'·N·K``
    entries (one per reachable tile; a few for a shift-invariant mask in a cached plan, but a plan is built from
    the length). ``drop_keys``: sorted key positions left out (or None)."""
    from .plan import FULL_TILE, PAD_TILE, _spans

    keep, N, first, _, _, K = _keep(q, mask, band, C, drop_keys)
    bp, hp = keep.shape[0], keep.shape[1]
    dev = q.device
    tiles = keep.view(bp, hp, N, C, K, C)                                 # [b', h', i, row, o, column]
    full = tiles.all(-1).all(3)                                           # (B', H', N, K)
    # the kernels read a tile's span as the union over its rows (the columns P·V visits): each row gets the
    # tile's own first and last column, from one pass over the tile instead of one per row
    cols = tiles.any(3)                                                   # (B', H', N, K, C)
    used = cols.any(-1)                                                   # (B', H', N, K): an allowed pair
    span = _spans(cols).unsqueeze(-2).expand(bp, hp, N, K, C, 2).reshape(-1, C, 2)   # (P, C, 2)
    bank = tiles.permute(0, 1, 2, 4, 5, 3).reshape(-1, C, C)              # key-major (P, BK, BQ)
    entry = torch.arange(bp * hp, device=dev).view(bp, hp, 1, 1) * N * K
    offset = torch.arange(K, device=dev)
    blocks = torch.arange(N, device=dev).view(N, 1)

    def tile(i: Tensor, o: Tensor) -> Tensor:
        """The tile entry of query block ``i`` and key block offset ``o`` (``-1`` FULL), ``(B', H', N, K)``."""
        local = i * K + o
        is_full = full.reshape(bp, hp, -1).gather(-1, local.reshape(bp, hp, -1)).view(local.shape)
        return torch.where(is_full, torch.full_like(local, FULL_TILE), entry + local)

    def compact(valid: Tensor, *xs: Tensor) -> tuple[Tensor, ...]:
        """Per row of ``valid (B', H', N, K)``: its count and each ``x`` with the valid entries first, in order."""
        order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
        count = valid.sum(-1)
        kept = offset < count.unsqueeze(-1)
        return (count.to(torch.int32),) + tuple(
            torch.where(kept, x.gather(-1, order), torch.full_like(x, PAD_TILE if n == 0 else 0)).to(torch.int32)
            .contiguous() for n, x in enumerate(xs))

    # query-major: the used tiles of query block i, key blocks i + first + o in increasing o
    whole = (bp, hp, N, K)
    o_q = offset.expand(whole)
    kv_n, kv_tile, kv_idx = compact(used, tile(blocks.expand(whole), o_q), (blocks + first + offset).expand(whole))
    # each used tile's slot in its query block's row (the fused backward's dS buffer)
    slot_of = torch.cumsum(used.to(torch.int32), dim=-1) - 1                          # (B', H', N, K)
    # key-major: the query blocks i = j - first - o that see key block j, in increasing i (decreasing o)
    o_k = (K - 1 - offset).expand(whole)
    i_k = blocks - first - o_k                                                        # (B', H', N, K)
    inside = (i_k >= 0) & (i_k < N)
    at = (i_k.clamp(0, N - 1) * K + o_k).reshape(bp, hp, -1)
    seen = inside & used.reshape(bp, hp, -1).gather(-1, at).view(whole)
    q_slot_all = slot_of.reshape(bp, hp, -1).gather(-1, at).view(whole)
    q_n, q_tile, q_idx, q_slot = compact(seen, tile(i_k.clamp(0, N - 1), o_k), i_k, q_slot_all)
    return (kv_n.contiguous(), kv_idx, kv_tile, q_n.contiguous(), q_idx, q_tile, q_slot, bank.contiguous(),
            span.contiguous())


def attend_dynamic(q: Tensor, k: Tensor, v: Tensor, mask: Mask, cover: Cover, scale: float,
                   block: int | None) -> Tensor:
    """Masked softmax attention of ``q (B, H, L, D)`` over ``k, v (B, H, L, *)`` for a mask inside ``cover``
    (:func:`cover_of`), with no block plan: the band's pairs on the engine's numba kernels (``block``: their block
    size, a :func:`band_index`) or in chunks of torch operators (``block`` None, :func:`attend_band`), the global
    keys' columns apart (their softmax merged with the band's by the two log-sum-exps), and the global queries'
    rows against every key, replacing those rows. Returns ``(B, H, L, E)``; a query with no allowed key gives 0."""
    lo, hi, gkeys, gqueries = cover
    dev = q.device
    drop = torch.tensor(gkeys, device=dev) if gkeys else None
    parts: list[tuple[Tensor, Tensor]] = []
    wanted = bool(gkeys or gqueries)      # the band's log-sum-exp (only a merge needs it)
    # the band's pairs have neither a global key (dropped there) nor a global query (rows replaced below): the
    # mask's parts that allow global pairs only are left out there
    mask_band = mask._without_globals() if wanted else mask
    if lo <= hi and mask_band is not None:
        if block is not None:
            from . import numba_ops

            res = numba_ops.attend_index(q, k, v, band_index(q, mask_band, (lo, hi), block, drop), (block, block),
                                         scale, return_lse=wanted)
            if not wanted:
                return res  # type: ignore[return-value]
            out, lse = res
            parts.append((out, torch.where(lse == math.inf, -math.inf, lse)))   # (+inf: a row with no key)
        else:
            res = attend_band(q, k, v, mask_band, (lo, hi), scale, drop_keys=drop, return_lse=wanted)
            if not wanted:
                return res  # type: ignore[return-value]
            parts.append(res)  # type: ignore[arg-type]
    if gkeys:
        parts.append(_global_keys(q, k, v, mask, drop, scale))    # type: ignore[arg-type]
    out = _merge(parts) if parts else q.new_zeros(*q.shape[:3], v.shape[-1]) + 0 * v.sum()
    if gqueries:
        out = _global_queries(q, k, v, mask, torch.tensor(gqueries, device=dev), scale, out)
    return out


def _indices(q: Tensor) -> tuple[Tensor, Tensor, Geometry]:
    B, H, L, _ = q.shape
    dev = q.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    return b, h, Geometry(B, H, L, L, dev, None)


def _masked_softmax(s: Tensor, keep: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(softmax(s) v, logsumexp(s))`` over the allowed entries ``keep`` of the last dim (0 and ``-inf`` for a row
    with none; masked at the lowest finite value, so such a row's gradients stay finite)."""
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
    some = keep.any(-1)
    out = (torch.softmax(s, -1) @ v).masked_fill(~some[..., None], 0.0)
    return out, torch.where(some, torch.logsumexp(s, -1), -math.inf)


def _global_keys(q: Tensor, k: Tensor, v: Tensor, mask: Mask, positions: Tensor, scale: float,
                 ) -> tuple[Tensor, Tensor]:
    """Every query against the keys at ``positions`` (those inside the sequence): ``(out, lse)``."""
    L = q.shape[2]
    at = positions.clamp(max=L - 1)       # positions past this length are masked below
    b, h, geom = _indices(q)
    qpos = torch.arange(L, device=q.device).view(1, 1, L, 1)
    keep = mask._keep(b, h, qpos, at.view(1, 1, 1, -1), geom) & (positions < L)
    s = (q * scale) @ k.index_select(2, at).transpose(-1, -2)          # (B, H, L, G)
    return _masked_softmax(s, keep.expand(s.shape), v.index_select(2, at))


def _global_queries(q: Tensor, k: Tensor, v: Tensor, mask: Mask, positions: Tensor, scale: float,
                    out: Tensor) -> Tensor:
    """``out`` with the rows at ``positions`` (those inside the sequence) attended against every key."""
    L = q.shape[2]
    at = positions.clamp(max=L - 1)
    b, h, geom = _indices(q)
    kpos = torch.arange(L, device=q.device)
    keep = mask._keep(b, h, at.view(1, 1, -1, 1), kpos.view(1, 1, 1, L), geom)
    s = (q.index_select(2, at) * scale) @ k.transpose(-1, -2)          # (B, H, G, L)
    rows, _ = _masked_softmax(s, keep.expand(s.shape), v)
    is_global, slot = members(positions, kpos)                         # row r is a global query, at slot[r]
    return torch.where(is_global.view(1, 1, L, 1), rows.index_select(2, slot).to(out.dtype), out)


def _merge(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """One softmax over disjoint key sets from each set's ``(out, lse)``: outputs weighted by
    ``exp(lse_i - lse)``; a row no set allows gives 0 (and no NaN gradient)."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse.float() if lse.dtype in (torch.float16, torch.bfloat16) else lse for _, lse in parts])
    none = torch.isneginf(lses).all(0)
    lses = torch.where(none, 0.0, lses)
    total = torch.logsumexp(lses, 0)
    out = sum(torch.exp(lses[i] - total)[..., None].to(o.dtype) * o for i, (o, _) in enumerate(parts))
    return out.masked_fill(none[..., None], 0.0)  # type: ignore[union-attr]
