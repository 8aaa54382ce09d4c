"""Building blocks of the patterns: mask objects whose block states are computed analytically.

Every pattern of this plugin is an :class:`attnkit.masks.Mask` made of these
atoms, composed with ``&`` and ``|`` (and the core's ``causal()`` /
``sliding_window()``). Each atom's element mask (``_keep``) is the
definition; its ``_blocks`` classifies every (query block, key block) tile
from the tile's position ranges in O(NQ·NK) small integer operations, so a
64K x 64K block index never evaluates the mask element by element. The
analytic path needs contiguous positions (the default, or an int offset);
explicit position tensors (packed sequences, streaming chunks) take the
core's exact evaluation (:meth:`attnkit.masks.Mask._blocks_by_evaluation`).

Positions follow :mod:`attnkit.positions`: key ``j`` at ``j``, query ``i`` at
``i + S - L`` by default.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit.caching import cached, outside_trace
from attnkit.errors import InvalidInputError
from attnkit.masks import Geometry, Mask, _gather, _states

__all__ = ["Atom", "PeriodicBand", "BlockBand", "KeyResidue", "PositionSet", "BlockTable", "contiguous",
           "tile_ranges", "hash_scores", "position_extent"]

#: stands for "unbounded" in position arithmetic (far beyond any sequence, far below int64 overflow)
BIG = 1 << 40


def contiguous(geom: Geometry) -> tuple[int, int] | None:
    """``(q0, k0)``, the positions of query 0 and key 0, when positions are contiguous ranges; else None."""
    p = geom.positions
    if p is not None and (p.q is not None or p.k is not None):
        return None
    qp, kp = geom.pos()
    q0 = int(qp[0, 0]) if geom.L else 0
    k0 = int(kp[0, 0]) if geom.S else 0
    return q0, k0


def tile_ranges(geom: Geometry, bq: int, bk: int, q0: int, k0: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """First and last position of every query block ``(NQ, 1)`` and key block ``(1, NK)`` (ragged last ok)."""
    dev = geom.device
    nq, nk = math.ceil(geom.L / bq), math.ceil(geom.S / bk)
    t = torch.arange(nq, device=dev)
    u = torch.arange(nk, device=dev)
    qlo = q0 + t * bq
    qhi = q0 + torch.clamp((t + 1) * bq, max=geom.L) - 1
    klo = k0 + u * bk
    khi = k0 + torch.clamp((u + 1) * bk, max=geom.S) - 1
    return qlo[:, None], qhi[:, None], klo[None, :], khi[None, :]


def position_extent(geom: Geometry) -> tuple[int, int]:
    """Smallest and largest position of any query or key (the extent a pattern's universe covers)."""
    qp, kp = geom.pos()
    with outside_trace(qp, kp):   # positions from sizes are real tensors while torch.export traces: read them
        lo = min(int(qp.min()) if qp.numel() else 0, int(kp.min()) if kp.numel() else 0)
        hi = max(int(qp.max()) if qp.numel() else 0, int(kp.max()) if kp.numel() else 0)
    return lo, hi


def hash_scores(seed: int, h: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Pseudo-random int64 scores of ``(seed, h, a, b)``, in [0, 2^31), the same on every device.

    A counter-based hash (three rounds of multiply-add modulo the prime 2^31 - 1,
    operands kept below 2^31 so nothing overflows int64): the score of a pair
    depends on nothing else, so a random pattern is the same whatever the
    sequence length, chunking or device.
    """
    P = 2147483647
    x = (h * 1000003 + (seed % P) * 7919 + 12345) % P
    for v in (a, b):
        x = (x * 48271 + (v % P + P) % P) % P
        x = (x * 16807 + 11) % P
        x = (x ^ (x >> 13)) % P
        x = (x * 48271) % P
    return x


class Atom(Mask):
    """An analytic pattern part: subclasses give ``_keep`` on positions and ``_tiles`` on tile ranges."""

    kind = "function"
    uses_positions = True

    def _keep(self, b, h, qi, ki, geom):
        qp, kp = geom.pos()
        return self._allow(h, _gather(qp, b, qi), _gather(kp, b, ki), geom)

    def _allow(self, h: Tensor, qpos: Tensor, kpos: Tensor, geom: Geometry) -> Tensor:
        raise NotImplementedError

    def _tiles(self, qlo: Tensor, qhi: Tensor, klo: Tensor, khi: Tensor, geom: Geometry) -> tuple[Tensor, Tensor]:
        """``(full, any)`` bool, broadcastable to ``(H', NQ, NK)``."""
        raise NotImplementedError

    def _blocks(self, geom, bq, bk):
        start = contiguous(geom)
        if start is None:
            return self._blocks_by_evaluation(geom, bq, bk)
        qlo, qhi, klo, khi = tile_ranges(geom, bq, bk, *start)
        full, any_ = self._tiles(qlo, qhi, klo, khi, geom)
        _, h_ = self._dims(geom)
        shape = (h_, qlo.shape[0], klo.shape[1])
        return _states(full.expand(shape), any_.expand(shape))[None].contiguous()


def _per_head(values: Tensor | int, geom: Geometry) -> Tensor | int:
    return values.to(geom.device).view(-1, 1, 1) if isinstance(values, Tensor) else values


class PeriodicBand(Atom):
    """``d = pos(q) - pos(k)`` is a multiple of ``period`` with ``-after·period <= d <= before·period``.

    ``before``/``after`` count steps of ``period`` (None: unbounded). ``period`` is
    an int or a per-head tuple (then the mask depends on the head).
    """

    def __init__(self, period: int | tuple[int, ...], before: int | None, after: int | None, name: str = "band"):
        super().__init__()
        self.name = name
        self.before = BIG if before is None else before
        self.after = BIG if after is None else after
        if isinstance(period, tuple):
            self.head_dependent = True
            self.period: Any = torch.tensor(period, dtype=torch.long)
            self.widest = max(int(p) for p in period)   # (a Python int: reading the tensor in a trace is an op)
        else:
            self.period = int(period)
            self.widest = self.period

    def check(self, geom, where="forward"):
        if isinstance(self.period, Tensor) and self.period.numel() != geom.H:
            raise InvalidInputError(
                f"{where}: {self.name}: expected one dilation per head (H = {geom.H}), got "
                f"{self.period.numel()} values {tuple(self.period.tolist())}")

    def _relative(self):
        return True   # a function of pos(q) - pos(k) (and of the head, for per-head periods)

    def _bounds(self, geom: Geometry) -> tuple[Any, Any, Any]:
        p = _per_head(self.period, geom)
        lo = -self.after * p if self.after < BIG else -BIG
        hi = self.before * p if self.before < BIG else BIG
        return p, lo, hi

    def _allow(self, h, qpos, kpos, geom):
        p, lo, hi = self._bounds(geom)
        if isinstance(p, Tensor):
            p, lo, hi = (x.view(-1)[h] if isinstance(x, Tensor) else x for x in (p, lo, hi))
        d = qpos - kpos
        return (d >= lo) & (d <= hi) & (d % p == 0)

    def _reach(self):
        if self.before >= BIG or self.after >= BIG:
            return None
        return -self.after * self.widest, self.before * self.widest

    def _tiles(self, qlo, qhi, klo, khi, geom):
        p, lo, hi = self._bounds(geom)
        dlo, dhi = qlo - khi, qhi - klo
        a = torch.maximum(dlo, torch.as_tensor(lo)) if isinstance(lo, Tensor) else dlo.clamp(min=lo)
        b = torch.minimum(dhi, torch.as_tensor(hi)) if isinstance(hi, Tensor) else dhi.clamp(max=hi)
        any_ = (a <= b) & (torch.div(b, p, rounding_mode="floor") * p >= a)
        full = (dlo >= lo) & (dhi <= hi) & ((p == 1) | ((dlo == dhi) & (dlo % p == 0)))
        return full, any_

    def __repr__(self) -> str:
        per = tuple(self.period.tolist()) if isinstance(self.period, Tensor) else self.period
        return f"{self.name}(period={per}, before={self.before if self.before < BIG else None}, " \
               f"after={self.after if self.after < BIG else None})"


class BlockBand(Atom):
    """With ``blk(p) = p // size``: ``lo <= blk(pos(k)) - blk(pos(q)) <= hi`` (``size`` may depend on the geometry)."""

    def __init__(self, size: int | None, lo: int, hi: int, name: str = "blocks"):
        super().__init__()
        self.size, self.lo, self.hi, self.name = size, lo, hi, name

    def block_size(self, geom: Geometry) -> int:
        assert self.size is not None
        return self.size

    def _reach(self):
        if self.size is None or type(self).block_size is not BlockBand.block_size:
            return None        # a block size that follows the geometry: no bound known without the shape
        s = self.size          # blk(k) - blk(q) in [lo, hi] puts k in [(blk(q) + lo)·s, (blk(q) + hi + 1)·s)
        return -(self.hi + 1) * s + 1, (1 - self.lo) * s - 1

    def _allow(self, h, qpos, kpos, geom):
        s = self.block_size(geom)
        d = torch.div(kpos, s, rounding_mode="floor") - torch.div(qpos, s, rounding_mode="floor")
        return (d >= self.lo) & (d <= self.hi)

    def _tiles(self, qlo, qhi, klo, khi, geom):
        s = self.block_size(geom)
        f = lambda x: torch.div(x, s, rounding_mode="floor")  # noqa: E731
        dlo, dhi = f(klo) - f(qhi), f(khi) - f(qlo)
        return (dlo >= self.lo) & (dhi <= self.hi), (dhi >= self.lo) & (dlo <= self.hi)

    def __repr__(self) -> str:
        return f"{self.name}(size={self.size}, lo={self.lo}, hi={self.hi})"


class KeyResidue(Atom):
    """``lo <= pos(k) mod period <= hi`` (the keys at fixed offsets of every period)."""

    def __init__(self, period: int, lo: int, hi: int, name: str = "columns"):
        super().__init__()
        self.period, self.lo, self.hi, self.name = period, lo, hi, name

    def _allow(self, h, qpos, kpos, geom):
        r = kpos % self.period
        return ((r >= self.lo) & (r <= self.hi)).expand(torch.broadcast_shapes(qpos.shape, kpos.shape))

    def _tiles(self, qlo, qhi, klo, khi, geom):
        p = self.period
        n = khi - klo + 1
        r0 = klo % p
        r1 = r0 + n - 1  # may pass p (wraps)
        any_ = (n >= p) | ((r0 <= self.hi) & (r1 >= self.lo)) | (r1 >= self.lo + p)
        full = ((r0 >= self.lo) & (r1 <= self.hi)) | torch.tensor(self.lo == 0 and self.hi == p - 1)
        shape = torch.broadcast_shapes(qlo.shape, klo.shape)
        return full.expand(shape), any_.expand(shape)

    def __repr__(self) -> str:
        return f"{self.name}(period={self.period}, residues {self.lo}..{self.hi})"


def members(positions: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """``(hit, slot)`` shaped as ``x``: whether ``x`` is one of ``positions`` (sorted) and, where it is, its index
    there (clamped into range elsewhere)."""
    if positions.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool), torch.zeros_like(x)
    slot = torch.searchsorted(positions, x.contiguous()).clamp(max=positions.numel() - 1)
    return positions[slot] == x, slot


class PositionSet(Atom):
    """The key (``side="key"``) or the query (``side="query"``) sits at one of ``positions``."""

    def __init__(self, positions: tuple[int, ...], side: str, name: str = "global"):
        super().__init__()
        self.positions = torch.tensor(sorted(positions), dtype=torch.long)
        self.side, self.name = side, name

    def _members(self, x: Tensor) -> Tensor:
        return members(self.positions.to(x.device), x)[0]

    def _allow(self, h, qpos, kpos, geom):
        hit = self._members(kpos if self.side == "key" else qpos)
        return hit.expand(torch.broadcast_shapes(qpos.shape, kpos.shape))

    def _cover(self):
        # no band: every allowed pair has its key (query) at one of the positions
        at = frozenset(int(p) for p in self.positions.tolist())
        return (math.inf, -math.inf, at, frozenset()) if self.side == "key" else (math.inf, -math.inf, frozenset(), at)

    def _count(self, lo: Tensor, hi: Tensor) -> Tensor:
        pos = self.positions.to(lo.device)
        return torch.searchsorted(pos, hi.contiguous(), right=True) - torch.searchsorted(pos, lo.contiguous())

    def _tiles(self, qlo, qhi, klo, khi, geom):
        lo, hi = (klo, khi) if self.side == "key" else (qlo, qhi)
        cnt = self._count(lo, hi)
        shape = torch.broadcast_shapes(qlo.shape, klo.shape)
        return (cnt == hi - lo + 1).expand(shape), (cnt > 0).expand(shape)

    def __repr__(self) -> str:
        return f"{self.name}({self.side}s at {tuple(self.positions.tolist())})"


class BlockTable(Atom):
    """A pattern on blocks of ``size`` positions, given as a table ``sel (H', NQB, NKB)`` of (query block, key block).

    Subclasses build the table from the geometry (:meth:`table`): it returns
    ``(qb0, kb0, sel)``, the first query / key block the table covers and the
    bool table; pairs outside it are not allowed. Tiles are classified exactly
    with 2-D prefix sums of the table.
    """

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        self._tables: dict[Any, tuple[int, int, Tensor]] = {}

    def table(self, geom: Geometry) -> tuple[int, int, Tensor]:
        raise NotImplementedError

    def _cached_table(self, geom: Geometry) -> tuple[int, int, Tensor]:
        key = (position_extent(geom), geom.H if self.head_dependent else 1, str(geom.device),
               self._table_key(geom))
        # cached: never an inference tensor a later training call would meet, nor a fake one (torch.export), nor a
        # torch.func transform's wrapper
        return cached(self._tables, key, lambda: self.table(geom), self, geom, limit=8)

    def _table_key(self, geom: Geometry) -> Any:
        qp, _ = geom.pos()
        with outside_trace(qp):
            return (int(qp.min()), int(qp.max())) if qp.numel() else (0, 0)

    def _allow(self, h, qpos, kpos, geom):
        qb0, kb0, sel = self._cached_table(geom)
        nqb, nkb = sel.shape[-2], sel.shape[-1]
        a = torch.div(qpos, self.size, rounding_mode="floor") - qb0
        c = torch.div(kpos, self.size, rounding_mode="floor") - kb0
        inside = (a >= 0) & (a < nqb) & (c >= 0) & (c < nkb)
        hh = h if sel.shape[0] > 1 else torch.zeros_like(h)
        return sel[hh, a.clamp(0, nqb - 1), c.clamp(0, nkb - 1)] & inside

    def _tiles(self, qlo, qhi, klo, khi, geom):
        qb0, kb0, sel = self._cached_table(geom)
        nqb, nkb = sel.shape[-2], sel.shape[-1]
        s = self.size
        a0 = torch.div(qlo, s, rounding_mode="floor") - qb0
        a1 = torch.div(qhi, s, rounding_mode="floor") - qb0
        c0 = torch.div(klo, s, rounding_mode="floor") - kb0
        c1 = torch.div(khi, s, rounding_mode="floor") - kb0
        area = (a1 - a0 + 1) * (c1 - c0 + 1)
        csum = torch.zeros(sel.shape[0], nqb + 1, nkb + 1, dtype=torch.int64, device=sel.device)
        csum[:, 1:, 1:] = sel.to(torch.int64).cumsum(1).cumsum(2)
        A0, A1 = a0.clamp(0, nqb), (a1 + 1).clamp(0, nqb)
        C0, C1 = c0.clamp(0, nkb), (c1 + 1).clamp(0, nkb)
        A0, A1 = A0.expand(-1, C0.shape[1]), A1.expand(-1, C0.shape[1])
        C0, C1 = C0.expand(A0.shape[0], -1), C1.expand(A0.shape[0], -1)
        cnt = csum[:, A1, C1] - csum[:, A0, C1] - csum[:, A1, C0] + csum[:, A0, C0]
        return cnt == area, cnt > 0
