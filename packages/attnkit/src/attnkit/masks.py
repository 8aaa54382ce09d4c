"""Masks as objects: a mask function of ``(b, h, q, kv)`` plus a block index computed once.

The idea is PyTorch FlexAttention's: a mask says, for batch ``b``, head ``h``,
query ``q`` and key ``kv``, whether the pair may attend. Alongside it, for a
grid of (query block, key block) tiles, a :class:`BlockIndex` says which tiles
are fully allowed, partially allowed (the element mask is needed) or skipped;
it is computed once per shape and block size and cached on the mask. Kernels
execute block indices, so a pattern written as a mask function runs on them.

Constructors::

    attnkit.masks.causal()                      # bottom-right aligned (query i at i + S - L)
    attnkit.masks.key_padding(kpm)              # bool (B, S), True = a real token
    attnkit.masks.from_tensor(t)                # bool (True = attend) or additive float, -> (B, H, L, S)
    attnkit.masks.sliding_window(before, after=0)   # keys at positions p - before ... p + after
    attnkit.masks.document(q_ids, kv_ids=None)  # packed sequences: attend within one document
    attnkit.masks.from_function(fn, name=...)   # fn(b, h, q_pos, kv_pos) -> bool tensor

and ``m1 & m2`` (both allow), ``m1 | m2`` (either allows). Causal, sliding
window and function masks compare *positions* (see :mod:`attnkit.positions`):
by default key ``j`` sits at ``j`` and query ``i`` at ``i + S - L``. Tensor,
padding and document masks are indexed by sequence index.

Every mask has a *kind* (``"causal"``, ``"key_padding"``, ``"tensor"``,
``"sliding_window"``, ``"document"``, ``"function"``; a ``|`` adds
``"union"``). An implementation declares the kinds it honours
(:attr:`attnkit.Capabilities.mask_kinds`) and refuses the rest.

Conventions kept from version 1 (the helpers at the end of this module):
``key_padding_mask`` is bool ``(B, S)``, True = a real token; ``attn_mask`` is
bool (True = may attend) or additive float broadcastable to ``(B, H, L, S)``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import transforms as _transforms
from .caching import cached, outside_trace, reads_traced
from .errors import InvalidInputError
from .positions import Positions

__all__ = [
    "Mask", "BlockIndex", "Geometry", "MASK_KINDS", "SKIP", "PARTIAL", "FULL",
    "causal", "key_padding", "from_tensor", "sliding_window", "document", "from_function", "resolve",
    "causal_keep", "split_attn_mask", "keep_mask", "additive",
]

#: Every mask kind; ``"union"`` marks a ``|`` composition.
MASK_KINDS = ("causal", "key_padding", "tensor", "sliding_window", "document", "function", "union")

#: Block states in :attr:`BlockIndex.state`.
SKIP, PARTIAL, FULL = 0, 1, 2

#: Default (query, key) block size of block indices.
DEFAULT_BLOCK = (64, 64)

# rows evaluated at once when a mask function is evaluated for a block index
_EVAL_ELEMENTS = 1 << 21


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"[:120]


# ================================================================== geometry
@dataclass(frozen=True, eq=False)
class Geometry:
    """What a mask is evaluated against: sizes, device and positions.

    Attributes:
        B, H, L, S: batch, heads, queries, keys.
        device: where index tensors are made.
        positions: :class:`~attnkit.positions.Positions` or None (default alignment).
    """

    B: int
    H: int
    L: int
    S: int
    device: torch.device
    positions: Positions | None = None

    def pos(self) -> tuple[Tensor, Tensor]:
        """``(q_pos (B', L), k_pos (B', S))``, cached on the geometry."""
        cached = self.__dict__.get("_pos")
        if cached is None:
            p = self.positions or Positions()
            # real tensors while torch.export traces at static sizes (unless they come from traced position
            # inputs): tables built from position values (pattern tables) read them; the program holds them as
            # constants. A symbolic size stays in the trace.
            static = all(isinstance(n, int) for n in (self.B, self.L, self.S))
            with outside_trace(p) if static else contextlib.nullcontext():
                cached = p.resolve(self.B, self.L, self.S, self.device)
            object.__setattr__(self, "_pos", cached)
        return cached

    def cache_key(self) -> tuple[Any, ...] | None:
        pk = ("default",) if self.positions is None else self.positions.cache_key()
        if pk is None:
            return None
        return (self.B, self.H, self.L, self.S, str(self.device), pk)


def _gather(pos: Tensor, b: Tensor, idx: Tensor) -> Tensor:
    """``pos[b, idx]`` broadcasting a (1, N) position table over any batch index."""
    if pos.shape[0] == 1:
        return pos[0][idx]
    return pos[b, idx]


def _block_minmax(pos: Tensor, n: int, block: int) -> tuple[Tensor, Tensor]:
    """Per-block min and max of positions ``(B', n)`` -> ``(B', nb)`` each (ragged last block ok)."""
    nb = math.ceil(n / block) if n else 0
    pad = nb * block - n
    big = torch.iinfo(torch.int64).max // 4
    lo = torch.nn.functional.pad(pos, (0, pad), value=big).view(pos.shape[0], nb, block).amin(-1)
    hi = torch.nn.functional.pad(pos, (0, pad), value=-big).view(pos.shape[0], nb, block).amax(-1)
    return lo, hi


def _reduce_blocks(keep: Tensor, L: int, S: int, bq: int, bk: int) -> Tensor:
    """Block states from a bool tensor ``(B', H', L, S)`` (all -> FULL, none -> SKIP, else PARTIAL)."""
    nq, nk = math.ceil(L / bq), math.ceil(S / bk)
    pl, ps = nq * bq - L, nk * bk - S
    b_, h_ = keep.shape[0], keep.shape[1]
    valid = torch.ones(1, 1, L, S, dtype=torch.bool, device=keep.device)
    valid = torch.nn.functional.pad(valid, (0, ps, 0, pl), value=False)
    k = torch.nn.functional.pad(keep, (0, ps, 0, pl), value=False)
    k = k.view(b_, h_, nq, bq, nk, bk)
    v = valid.view(1, 1, nq, bq, nk, bk)
    anyk = k.any(dim=(3, 5))
    allk = (k | ~v).all(dim=(3, 5))
    return _states(allk, anyk)


def _states(full: Tensor, any_: Tensor) -> Tensor:
    # SKIP = 0, PARTIAL = 1, FULL = 2: any + (full and any)
    return any_.to(torch.int8) + (full & any_).to(torch.int8)


def _consecutive_positions(geom: Geometry) -> bool:
    """Query and key positions each step by exactly 1 (the default alignment, or an offset)."""
    if geom.positions is None:
        return True
    return all(bool((p.diff(dim=-1) == 1).all()) for p in geom.pos())


def _band_blocks(geom: Geometry, lo: float, hi: float, bq: int, bk: int) -> Tensor:
    """Block states ``(B', 1, NQ, NK)`` of the band ``lo <= q_pos - kv_pos <= hi`` from per-block min/max positions.

    FULL and SKIP-free (``any``) use the extreme differences ``q_min - kv_max`` and ``q_max - kv_min``,
    which some pair of the tile attains, so FULL is exact for any positions; ``any`` is exact when the
    differences inside a tile leave no gap (positions contiguous within blocks, e.g. the default).
    """
    qp, kp = geom.pos()
    qlo, qhi = _block_minmax(qp, geom.L, bq)
    klo, khi = _block_minmax(kp, geom.S, bk)
    if lo > hi or qlo.numel() == 0 or klo.numel() == 0:
        return torch.zeros(qlo.shape[0], 1, qlo.shape[1], klo.shape[1], dtype=torch.int8, device=qlo.device)
    # compare in the positions' range (an infinite bound is one no difference reaches)
    base = min(int(qlo.min()), int(klo.min()))
    span = max(int(qhi.max()), int(khi.max())) - base + 1
    lo_, hi_ = max(lo, -span), min(hi, span)
    dt = torch.int32 if span < (1 << 30) else torch.int64   # differences of positions shifted by base
    qlo, qhi = (qlo - base).to(dt)[:, :, None], (qhi - base).to(dt)[:, :, None]
    klo, khi = (klo - base).to(dt)[:, None, :], (khi - base).to(dt)[:, None, :]
    dmin, dmax = qlo - khi, qhi - klo
    full = (dmin >= lo_) & (dmax <= hi_)
    any_ = (dmax >= lo_) & (dmin <= hi_)
    return _states(full, any_)[:, None]


# ============================================================== block index
@dataclass(frozen=True, eq=False)
class BlockIndex:
    """Which (query block, key block) tiles a mask allows.

    Attributes:
        state: int8 ``(B', H', NQ, NK)`` with :data:`SKIP` (no pair allowed),
            :data:`PARTIAL` (some: apply the element mask) or :data:`FULL`
            (every pair of the tile allowed). B' and H' are 1 when the mask
            does not depend on the batch element or the head.
        block_size: ``(BQ, BK)``; the last block of each axis may be ragged.
        L, S: the sequence lengths it was computed for.
    """

    state: Tensor
    block_size: tuple[int, int]
    L: int
    S: int

    @property
    def num_blocks(self) -> tuple[int, int]:
        return int(self.state.shape[-2]), int(self.state.shape[-1])

    def _indices(self, which: Tensor) -> tuple[Tensor, Tensor]:
        counts = which.sum(-1, dtype=torch.int32)
        nk = which.shape[-1]
        # stable: selected blocks first, in ascending key-block order
        order_key = (~which).to(torch.int32) * nk + torch.arange(nk, device=which.device, dtype=torch.int32)
        idx = order_key.argsort(dim=-1, stable=True).to(torch.int32)
        return counts, idx

    def kv_indices(self) -> tuple[Tensor, Tensor]:
        """Non-skipped key blocks per query block: ``(counts (B', H', NQ), indices (B', H', NQ, NK))``.

        ``indices[..., :counts]`` are the key blocks to visit in ascending order
        (FlexAttention's ``kv_num_blocks``/``kv_indices``); the rest is padding.
        """
        return self._indices(self.state != SKIP)

    def full_kv_indices(self) -> tuple[Tensor, Tensor]:
        """Like :meth:`kv_indices` for FULL tiles only (no element mask needed)."""
        return self._indices(self.state == FULL)

    def partial_kv_indices(self) -> tuple[Tensor, Tensor]:
        """Like :meth:`kv_indices` for PARTIAL tiles only (the element mask applies)."""
        return self._indices(self.state == PARTIAL)

    @property
    def density(self) -> float:
        """Fraction of tiles not skipped (1.0 = dense)."""
        n = self.state.numel()
        return float((self.state != SKIP).sum()) / n if n else 0.0

    def to_dense(self) -> Tensor:
        """Bool ``(B', H', L, S)``: True inside non-skipped tiles (for plots and tests)."""
        bq, bk = self.block_size
        d = (self.state != SKIP).repeat_interleave(bq, -2).repeat_interleave(bk, -1)
        return d[..., : self.L, : self.S]

    def __repr__(self) -> str:
        nq, nk = self.num_blocks
        return (f"BlockIndex(L={self.L}, S={self.S}, block_size={self.block_size}, blocks={nq}x{nk}, "
                f"batch_heads={tuple(self.state.shape[:2])}, density={self.density:.3f})")


# ==================================================================== masks
class Mask:
    """Base class of mask objects: subclasses define :meth:`_keep` (and may speed up :meth:`_blocks`).

    A mask is a boolean function of ``(b, h, q, kv)``; combine masks with ``&``
    and ``|``. Public methods take the shape and return tensors; none of them
    is needed to *write* a mask: :func:`from_function` turns a plain function
    into one.
    """

    kind: str = "function"
    #: depends on the batch element / the head (so the block index has B' = B / H' = H)
    batch_dependent: bool = False
    head_dependent: bool = False

    def __init__(self) -> None:
        # block indices per shape; a race between threads only computes one twice
        self._cache: dict[tuple[Any, ...], BlockIndex] = {}

    # -- what subclasses provide
    def _keep(self, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor, geom: Geometry) -> Tensor:
        """Bool, broadcast of index tensors ``b (B',1,1,1)``, ``h (1,H',1,1)``, ``qi (1,1,Lq,1)``, ``ki (1,1,1,S)``."""
        raise NotImplementedError

    def _blocks(self, geom: Geometry, bq: int, bk: int) -> Tensor:
        """Block states ``(B', H', NQ, NK)``; default: evaluate the mask a band of query rows at a time."""
        return self._blocks_by_evaluation(geom, bq, bk)

    def _band(self) -> tuple[float, float] | None:
        """``(lo, hi)`` when the mask is exactly ``lo <= q_pos - kv_pos <= hi`` (a position band), else None."""
        return None

    def _reach(self) -> tuple[float, float] | None:
        """``(lo, hi)`` such that every allowed pair has ``lo <= q_pos - kv_pos <= hi`` (a band holding the mask,
        not necessarily equal to it), or None when no such bound is known. Default: :meth:`_band`. A code path
        that cannot build a block plan (a length ``torch.export`` traces as dynamic) attends within it."""
        return self._band()

    def _cover(self) -> tuple[float, float, frozenset[int], frozenset[int]] | None:
        """``(lo, hi, keys, queries)`` such that every allowed pair has ``lo <= q_pos - kv_pos <= hi``, or its key
        position in ``keys``, or its query position in ``queries`` (a band with global keys and queries holding
        the mask; ``lo > hi`` for no band), or None when no such bound is known. Default: :meth:`_reach` with no
        global positions; position sets (global tokens) and ``&`` / ``|`` of covered parts define their own. A
        dynamic-length program attends within the band and to the global positions apart."""
        reach = self._reach()
        return None if reach is None else (reach[0], reach[1], frozenset(), frozenset())

    def _without_globals(self) -> Mask | None:
        """This mask on the pairs whose key and query are not among the global positions of :meth:`_cover`: the
        ``|``-ed parts whose cover has no band (they allow global pairs only) left out, through ``&`` and ``|``;
        None when no such pair is allowed. Default: the mask itself."""
        return self

    def _relative(self) -> bool:
        """True when the mask depends on the query and key positions only through ``q_pos - kv_pos`` (it may
        depend on ``b`` and ``h``): its element mask over a grid of pairs is the same at every shift of the grid,
        so a dynamic-length program evaluates it once per chunk shape. Default: an exact position band
        (:meth:`_band`); ``&`` / ``|`` of relative parts are relative."""
        return self._band() is not None

    def _shift_invariant(self, geom: Geometry) -> bool:
        """True when, on ``geom``, the mask depends only on ``q_idx - kv_idx`` (not on b, h or the indices
        themselves), so two tiles with the same offset and the same valid region have the same element mask."""
        return False

    def check(self, geom: Geometry, where: str = "forward") -> None:
        """Raise :class:`InvalidInputError` when the mask cannot apply to this shape/device."""

    def bias(self, geom: Geometry, dtype: torch.dtype) -> Tensor | None:
        """An additive float bias broadcastable to ``(B, H, L, S)``, or None."""
        return None

    @property
    def has_bias(self) -> bool:
        return False

    # -- derived
    @property
    def kinds(self) -> frozenset[str]:
        """The kinds of the leaves of this mask (``"union"`` when ``|`` is involved)."""
        return frozenset({self.kind})

    def leaves(self) -> list[Mask]:
        return [self]

    def conjuncts(self) -> list[Mask]:
        """The ``&``-ed parts: leaves, and unions (``|``) as atomic parts of kind ``"union"``."""
        return [self]

    #: compares positions (so per-batch position tensors make it batch dependent)
    uses_positions: bool = False

    def _dims(self, geom: Geometry) -> tuple[int, int]:
        per_batch = self.batch_dependent or (
            self.uses_positions and geom.positions is not None and any(p.shape[0] > 1 for p in geom.pos()))
        return (geom.B if per_batch else 1), (geom.H if self.head_dependent else 1)

    def _index(self, geom: Geometry, q0: int = 0, q1: int | None = None) -> tuple[Tensor, ...]:
        q1 = geom.L if q1 is None else q1
        b_, h_ = self._dims(geom)
        dev = geom.device
        b = torch.arange(b_, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(h_, device=dev).view(1, -1, 1, 1)
        qi = torch.arange(q0, q1, device=dev).view(1, 1, -1, 1)
        ki = torch.arange(geom.S, device=dev).view(1, 1, 1, -1)
        return b, h, qi, ki

    def dense(self, geom: Geometry) -> Tensor:
        """Bool ``(B', H', L, S)`` (True = may attend). Materialises the whole mask: references and tests."""
        b, h, qi, ki = self._index(geom)
        keep = self._keep(b, h, qi, ki, geom)
        b_, h_ = self._dims(geom)
        return keep.expand(b_, h_, geom.L, geom.S)

    def _blocks_by_evaluation(self, geom: Geometry, bq: int, bk: int) -> Tensor:
        b_, h_ = self._dims(geom)
        rows = max(bq, (_EVAL_ELEMENTS // max(1, geom.S * b_ * h_)) // bq * bq)
        parts = []
        for q0 in range(0, geom.L, rows):
            q1 = min(geom.L, q0 + rows)
            b, h, qi, ki = self._index(geom, q0, q1)
            keep = self._keep(b, h, qi, ki, geom).expand(b_, h_, q1 - q0, geom.S)
            parts.append(_reduce_blocks(keep, q1 - q0, geom.S, bq, bk))
        if not parts:
            return torch.zeros(b_, h_, 0, math.ceil(geom.S / bk), dtype=torch.int8, device=geom.device)
        return torch.cat(parts, dim=2)

    def _refine(self, geom: Geometry, state: Tensor, ambiguous: Tensor, bq: int, bk: int) -> Tensor:
        """Re-classify the ``ambiguous`` PARTIAL tiles of a composition by evaluating the mask on them alone."""
        idx = ambiguous.nonzero()
        if idx.numel() == 0:
            return state
        state = state.clone()
        dev = geom.device
        per = max(1, _EVAL_ELEMENTS // (bq * bk))
        for c0 in range(0, idx.shape[0], per):
            part = idx[c0:c0 + per]
            n = part.shape[0]
            b = part[:, 0].view(n, 1, 1, 1)
            h = part[:, 1].view(n, 1, 1, 1)
            qi = part[:, 2].view(n, 1, 1, 1) * bq + torch.arange(bq, device=dev).view(1, 1, bq, 1)
            ki = part[:, 3].view(n, 1, 1, 1) * bk + torch.arange(bk, device=dev).view(1, 1, 1, bk)
            valid = (qi < geom.L) & (ki < geom.S)
            keep = self._keep(b, h, qi.clamp(max=geom.L - 1), ki.clamp(max=geom.S - 1), geom)
            keep = keep.expand(n, 1, bq, bk)
            any_ = (keep & valid).flatten(1).any(-1)
            all_ = (keep | ~valid).flatten(1).all(-1)
            state[part[:, 0], part[:, 1], part[:, 2], part[:, 3]] = _states(all_, any_)
        return state

    def block_index(self, B: int, H: int, L: int, S: int, *, block_size: int | tuple[int, int] = DEFAULT_BLOCK,
                    device: torch.device | str = "cpu", positions: Positions | None = None) -> BlockIndex:
        """The :class:`BlockIndex` for this shape and block size, computed once and cached on the mask.

        Args:
            B, H, L, S: batch, heads, queries, keys.
            block_size: ``BQ`` or ``(BQ, BK)``.
            device: where the index lives.
            positions: positions (see :mod:`attnkit.positions`); an index for
                explicit position tensors is not cached.

        Raises:
            InvalidInputError: a block size below 1; a mask that does not fit the shape.
        """
        bq, bk = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
        for name, n in (("block_size (query)", bq), ("block_size (key)", bk)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise InvalidInputError(f"{name}: expected an int >= 1, got {n!r}")
        geom = Geometry(B, H, L, S, torch.device(device), positions)
        key = geom.cache_key()

        def build() -> BlockIndex:
            self.check(geom, "block_index")
            return BlockIndex(self._blocks(geom, bq, bk), (bq, bk), L, S)

        # cached: never an inference tensor a later training call would meet, nor (under torch.export) a fake one,
        # nor a torch.func transform's wrapper
        return cached(self._cache, None if key is None else (*key, bq, bk), build, self, positions, limit=32)

    def mask_mod(self, geom: Geometry) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """A FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx)`` bound to ``geom`` (indices, not positions)."""

        def mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self._keep(b, h, q_idx, kv_idx, geom)

        return mod

    # -- composition
    def __and__(self, other: Any) -> Mask:
        if other is None:
            return self
        if not isinstance(other, Mask):
            return NotImplemented
        return _And([self, other])

    def __rand__(self, other: Any) -> Mask:
        if other is None:
            return self
        return NotImplemented

    def __or__(self, other: Any) -> Mask:
        if not isinstance(other, Mask):
            return NotImplemented
        return _Or([self, other])

    # -- what implementations ask
    @property
    def is_causal(self) -> bool:
        """True when a causal mask is one of the ``&``-ed parts (the whole mask is at most causal)."""
        return any(isinstance(p, _Causal) for p in self.conjuncts())

    @property
    def key_padding_mask(self) -> Tensor | None:
        """The ``&`` of every key padding part, bool ``(B, S)``, or None."""
        kpm = None
        for p in self.conjuncts():
            if isinstance(p, _KeyPadding):
                kpm = p.kpm if kpm is None else kpm & p.kpm
        return kpm

    def without(self, *kinds: str) -> Mask | None:
        """This mask with the ``&``-ed parts of ``kinds`` removed (None when nothing is left).

        A union (``|``) is one part of kind ``"union"``: parts inside it stay.
        """
        rest = [p for p in self.conjuncts() if p.kind not in kinds]
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else _And(rest)

    def __repr__(self) -> str:
        return f"{type(self).__name__.lstrip('_')}()"


class _Causal(Mask):
    kind = "causal"
    uses_positions = True

    def _keep(self, b, h, qi, ki, geom):
        qp, kp = geom.pos()
        return _gather(qp, b, qi) >= _gather(kp, b, ki)

    def _band(self):
        return (0, math.inf)

    def _shift_invariant(self, geom):
        return geom.positions is None

    def _blocks(self, geom, bq, bk):
        return _band_blocks(geom, 0, math.inf, bq, bk)

    def __repr__(self) -> str:
        return "causal()"


class _SlidingWindow(Mask):
    kind = "sliding_window"
    uses_positions = True

    def __init__(self, before: int, after: int) -> None:
        super().__init__()
        self.before, self.after = before, after

    def _keep(self, b, h, qi, ki, geom):
        qp, kp = geom.pos()
        d = _gather(qp, b, qi) - _gather(kp, b, ki)  # how far back the key is
        return (d <= self.before) & (d >= -self.after)

    def _band(self):
        return (-self.after, self.before)

    def _shift_invariant(self, geom):
        return geom.positions is None

    def _blocks(self, geom, bq, bk):
        return _band_blocks(geom, -self.after, self.before, bq, bk)

    def __repr__(self) -> str:
        return f"sliding_window(before={self.before}, after={self.after})"


class _KeyPadding(Mask):
    kind = "key_padding"
    batch_dependent = True

    def __init__(self, kpm: Tensor) -> None:
        super().__init__()
        self.kpm = kpm

    def check(self, geom, where="forward"):
        if tuple(self.kpm.shape) != (geom.B, geom.S):
            raise InvalidInputError(
                f"{where}: key_padding_mask must have shape (B, S) = ({geom.B}, {geom.S}), "
                f"got {tuple(self.kpm.shape)}")
        if self.kpm.device != geom.device:
            raise InvalidInputError(
                f"{where}: key_padding_mask must be on {geom.device} like q, got {self.kpm.device}")

    def _keep(self, b, h, qi, ki, geom):
        return self.kpm[b, ki]

    def _blocks(self, geom, bq, bk):
        nq = math.ceil(geom.L / bq)
        k = self.kpm[:, None, None, :].expand(geom.B, 1, 1, geom.S)
        per_key = _reduce_blocks(k, 1, geom.S, 1, bk)  # (B, 1, 1, NK)
        return per_key.expand(geom.B, 1, nq, per_key.shape[-1])

    def __repr__(self) -> str:
        return f"key_padding({tuple(self.kpm.shape)})"


class _Document(Mask):
    kind = "document"
    batch_dependent = True

    def __init__(self, q_ids: Tensor, kv_ids: Tensor | None) -> None:
        super().__init__()
        self.q_ids, self.kv_ids = q_ids, kv_ids

    def _ids(self) -> tuple[Tensor, Tensor]:
        return self.q_ids, (self.q_ids if self.kv_ids is None else self.kv_ids)

    def check(self, geom, where="forward"):
        q, k = self._ids()
        for name, t, n in (("q_ids", q, geom.L), ("kv_ids", k, geom.S)):
            if t.shape[0] not in (1, geom.B) or t.shape[1] != n:
                raise InvalidInputError(
                    f"{where}: document mask {name} must have shape (B, {'L' if name == 'q_ids' else 'S'}) = "
                    f"({geom.B}, {n}), got {tuple(t.shape)}")
            if t.device != geom.device:
                raise InvalidInputError(f"{where}: document mask {name} must be on {geom.device}, got {t.device}")

    def _keep(self, b, h, qi, ki, geom):
        q, k = self._ids()
        return _gather(q, b, qi) == _gather(k, b, ki)

    def _blocks(self, geom, bq, bk):
        q, k = self._ids()
        qlo, qhi = _block_minmax(q, geom.L, bq)
        klo, khi = _block_minmax(k, geom.S, bk)
        qlo, qhi, klo, khi = qlo[:, :, None], qhi[:, :, None], klo[:, None, :], khi[:, None, :]
        full = (qlo == qhi) & (klo == khi) & (qlo == klo)
        any_ = (klo <= qhi) & (qlo <= khi)
        out = _states(full, any_)[:, None]
        return out.expand(geom.B, 1, *out.shape[2:]) if out.shape[0] == 1 else out

    def __repr__(self) -> str:
        return f"document({tuple(self.q_ids.shape)})"


class _TensorMask(Mask):
    kind = "tensor"

    def __init__(self, t: Tensor) -> None:
        super().__init__()
        self.t = t
        if t.dtype == torch.bool:
            self.keep_t, self.bias_t = t, None
        else:
            forbidden = torch.isneginf(t)
            self.keep_t = ~forbidden if _may_hold(forbidden) else None
            self.bias_t = t.masked_fill(forbidden, 0.0)
        shape = (1,) * (4 - t.dim()) + tuple(t.shape)
        self.shape4 = shape
        self.batch_dependent = shape[0] != 1
        self.head_dependent = shape[1] != 1

    @property
    def has_bias(self) -> bool:
        return self.bias_t is not None

    def check(self, geom, where="forward"):
        full = (geom.B, geom.H, geom.L, geom.S)
        ok = self.t.dim() <= 4 and all(a in (1, b) for a, b in zip(reversed(tuple(self.t.shape)), reversed(full)))
        if not ok or self.shape4[2] != geom.L or self.shape4[3] != geom.S:
            raise InvalidInputError(
                f"{where}: attn_mask must be broadcastable to (B, H, L, S) = {full} with its last two "
                f"dims (L, S), got shape {tuple(self.t.shape)}")
        if self.t.device != geom.device:
            raise InvalidInputError(f"{where}: attn_mask must be on {geom.device} like q, got {self.t.device}")

    def _keep(self, b, h, qi, ki, geom):
        if self.keep_t is None:
            return torch.ones((), dtype=torch.bool, device=geom.device).expand(1, 1, 1, 1)
        k = self.keep_t.reshape(self.shape4)
        bb = b if k.shape[0] != 1 else torch.zeros_like(b)
        hh = h if k.shape[1] != 1 else torch.zeros_like(h)
        return k[bb, hh, qi, ki]

    def dense(self, geom):
        b_, h_ = self._dims(geom)
        if self.keep_t is None:
            return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=geom.device).expand(b_, h_, geom.L, geom.S)
        return self.keep_t.reshape(self.shape4).expand(b_, h_, geom.L, geom.S)

    def _blocks(self, geom, bq, bk):
        return _reduce_blocks(self.dense(geom), geom.L, geom.S, bq, bk)

    def bias(self, geom, dtype):
        return None if self.bias_t is None else self.bias_t.reshape(self.shape4).to(dtype)

    def __repr__(self) -> str:
        what = "bool" if self.t.dtype == torch.bool else "additive"
        return f"from_tensor({what} {tuple(self.t.shape)})"


class _Function(Mask):
    kind = "function"
    uses_positions = True

    def __init__(self, fn: Callable[..., Tensor], name: str, batch_dependent: bool, head_dependent: bool) -> None:
        super().__init__()
        self.fn, self.name = fn, name
        self.batch_dependent, self.head_dependent = batch_dependent, head_dependent

    def _keep(self, b, h, qi, ki, geom):
        qp, kp = geom.pos()
        qpos, kpos = _gather(qp, b, qi), _gather(kp, b, ki)
        try:
            out = self.fn(b, h, qpos, kpos)
        except Exception as exc:
            raise InvalidInputError(
                f"mask function {self.name!r} raised {type(exc).__name__}: {exc} (it is called with "
                "broadcastable int64 tensors b, h, q_pos, kv_pos and must return a bool tensor)") from exc
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            raise InvalidInputError(
                f"mask function {self.name!r} must return a bool tensor (True = may attend), got {_describe(out)}")
        # the shape of the pairs asked for: (B', H', L, S) for a whole mask; engines that evaluate gathered
        # pairs pass index tensors of more dimensions (blocks, chunks), broadcast the same way
        want = torch.broadcast_shapes(b.shape, h.shape, qi.shape, ki.shape)
        try:
            torch.broadcast_shapes(out.shape, want)
        except RuntimeError:
            raise InvalidInputError(
                f"mask function {self.name!r} returned shape {tuple(out.shape)}, not broadcastable to the "
                f"(b, h, q_pos, kv_pos) it was called with, {tuple(want)}") from None
        return out

    def __repr__(self) -> str:
        return f"from_function({self.name!r})"


class _Band(Mask):
    """``lo <= q_pos - kv_pos <= hi``: the ``&`` of causal and sliding-window parts, classified in one pass."""

    uses_positions = True

    def __init__(self, lo: float, hi: float) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi

    def _keep(self, b, h, qi, ki, geom):
        qp, kp = geom.pos()
        d = _gather(qp, b, qi) - _gather(kp, b, ki)
        return (d >= self.lo) & (d <= self.hi)

    def _band(self):
        return (self.lo, self.hi)

    def _blocks(self, geom, bq, bk):
        return _band_blocks(geom, self.lo, self.hi, bq, bk)


class _Compound(Mask):
    op = "&"

    def __init__(self, parts: Iterable[Mask]) -> None:
        super().__init__()
        flat: list[Mask] = []
        for p in parts:
            flat.extend(p.parts if type(p) is type(self) else [p])  # type: ignore[attr-defined]
        self.parts = flat
        self.batch_dependent = any(p.batch_dependent for p in flat)
        self.head_dependent = any(p.head_dependent for p in flat)
        self.uses_positions = any(p.uses_positions for p in flat)

    def leaves(self):
        return [leaf for p in self.parts for leaf in p.leaves()]

    def check(self, geom, where="forward"):
        for p in self.parts:
            p.check(geom, where)

    @property
    def has_bias(self) -> bool:
        return any(p.has_bias for p in self.parts)

    def _keep(self, b, h, qi, ki, geom):
        keep = None
        for p in self.parts:
            k = p._keep(b, h, qi, ki, geom)
            keep = k if keep is None else self._combine_keep(keep, k)
        return keep

    def _shift_invariant(self, geom):
        return all(p._shift_invariant(geom) for p in self.parts)

    def _relative(self):
        return all(p._relative() for p in self.parts)

    def _block_parts(self, geom: Geometry) -> list[Mask]:
        return self.parts

    def _blocks(self, geom, bq, bk):
        states = [p._blocks(geom, bq, bk) for p in self._block_parts(geom)]
        if len(states) == 1:
            return states[0]
        shape = torch.broadcast_shapes(*(s.shape for s in states))
        out = states[0].expand(shape)
        for s in states[1:]:
            out = self._combine_states(out, s.expand(shape))
        # two partial tiles may together allow nothing (or everything): evaluate those tiles exactly
        partials = sum((s.expand(shape) == PARTIAL).to(torch.int8) for s in states)
        return self._refine(geom, out.contiguous(), (out == PARTIAL) & (partials >= 2), bq, bk)

    def __repr__(self) -> str:
        return "(" + f" {self.op} ".join(repr(p) for p in self.parts) + ")"


class _And(_Compound):
    op = "&"

    @property
    def kinds(self):
        return frozenset().union(*(p.kinds for p in self.parts))

    def conjuncts(self):
        return [c for p in self.parts for c in p.conjuncts()]

    def _band(self):
        bands = [p._band() for p in self.parts]
        if any(b is None for b in bands):
            return None
        return max(b[0] for b in bands), min(b[1] for b in bands)  # type: ignore[index]

    def _reach(self):
        reaches = [r for r in (p._reach() for p in self.parts) if r is not None]
        if not reaches:
            return None
        return max(r[0] for r in reaches), min(r[1] for r in reaches)

    def _without_globals(self):
        parts = [p._without_globals() for p in self.parts]
        return None if any(p is None for p in parts) else functools.reduce(operator.and_, parts)

    def _cover(self):
        # a pair allowed by every part lies in every part's band, or in some part's global positions
        covers = [c for c in (p._cover() for p in self.parts) if c is not None]
        if not covers:
            return None
        return (max(c[0] for c in covers), min(c[1] for c in covers), frozenset().union(*(c[2] for c in covers)),
                frozenset().union(*(c[3] for c in covers)))

    def _block_parts(self, geom):
        # position bands (causal, sliding windows) intersect into one band, classified exactly from block
        # min/max positions when positions are contiguous within blocks (the default): no tile needs _refine
        if not _consecutive_positions(geom):
            return self.parts
        bands = [p for p in self.parts if p._band() is not None]
        if len(bands) < 2:
            return self.parts
        lo = max(p._band()[0] for p in bands)  # type: ignore[index]
        hi = min(p._band()[1] for p in bands)  # type: ignore[index]
        return [_Band(lo, hi)] + [p for p in self.parts if p._band() is None]

    @staticmethod
    def _combine_keep(a: Tensor, b: Tensor) -> Tensor:
        return a & b

    @staticmethod
    def _combine_states(a: Tensor, b: Tensor) -> Tensor:
        return torch.minimum(a, b)  # SKIP < PARTIAL < FULL

    def bias(self, geom, dtype):
        out = None
        for p in self.parts:
            bb = p.bias(geom, dtype)
            if bb is not None:
                out = bb if out is None else out + bb
        return out


class _Or(_Compound):
    op = "|"

    def __init__(self, parts: Iterable[Mask]) -> None:
        super().__init__(parts)
        if any(p.has_bias for p in self.parts):
            raise InvalidInputError(
                "mask |: an additive float mask (a bias) cannot be part of a union; use a bool mask, or "
                "combine biases with &")

    kind = "union"

    @property
    def kinds(self):
        return frozenset({"union"}).union(*(p.kinds for p in self.parts))

    def conjuncts(self):
        return [self]  # one atomic part of kind "union"

    def _reach(self):
        reaches = [p._reach() for p in self.parts]
        if any(r is None for r in reaches):
            return None
        return min(r[0] for r in reaches), max(r[1] for r in reaches)  # type: ignore[index]

    def _without_globals(self):
        def has_band(p: Mask) -> bool:
            cover = p._cover()
            return cover is None or cover[0] <= cover[1]

        kept = [m for m in (p._without_globals() for p in self.parts if has_band(p)) if m is not None]
        return functools.reduce(operator.or_, kept) if kept else None

    def _cover(self):
        covers = [p._cover() for p in self.parts]
        if any(c is None for c in covers):
            return None
        bands = [c for c in covers if c[0] <= c[1]]  # type: ignore[index]
        lo = min((c[0] for c in bands), default=math.inf)  # type: ignore[index]
        hi = max((c[1] for c in bands), default=-math.inf)  # type: ignore[index]
        return (lo, hi, frozenset().union(*(c[2] for c in covers)),  # type: ignore[index]
                frozenset().union(*(c[3] for c in covers)))  # type: ignore[index]

    @staticmethod
    def _combine_keep(a: Tensor, b: Tensor) -> Tensor:
        return a | b

    @staticmethod
    def _combine_states(a: Tensor, b: Tensor) -> Tensor:
        # FULL if either is FULL, SKIP only if both are, else PARTIAL
        either_full = (a == FULL) | (b == FULL)
        both_skip = (a == SKIP) & (b == SKIP)
        return torch.where(either_full, torch.full_like(a, FULL),
                           torch.where(both_skip, torch.full_like(a, SKIP), torch.full_like(a, PARTIAL)))


# ============================================================== constructors
def causal() -> Mask:
    """Query at position ``p`` sees keys at positions ``<= p`` (bottom-right aligned by default)."""
    return _Causal()


def key_padding(key_padding_mask: Tensor) -> Mask:
    """Key padding: bool ``(B, S)``, True = a real token; padded keys have no influence.

    Raises:
        InvalidInputError: not a bool tensor of rank 2.
    """
    kpm = key_padding_mask
    if not isinstance(kpm, Tensor):
        raise InvalidInputError(f"key_padding_mask must be a bool tensor (B, S), got {_describe(kpm)}")
    if kpm.dtype != torch.bool:
        raise InvalidInputError(
            f"key_padding_mask must be bool (True = real token), got dtype {kpm.dtype}; convert with "
            "mask.bool() (note: attnkit's True means keep, unlike nn.MultiheadAttention)")
    if kpm.dim() != 2:
        raise InvalidInputError(f"key_padding_mask must have shape (B, S), got {tuple(kpm.shape)}")
    return _KeyPadding(kpm)


def from_tensor(attn_mask: Tensor) -> Mask:
    """A dense mask: bool (True = may attend) or additive float (``-inf`` forbids), broadcastable to ``(B, H, L, S)``.

    Raises:
        InvalidInputError: not a tensor, an integer dtype, rank above 4 or below 2.
    """
    m = attn_mask
    if not isinstance(m, Tensor):
        raise InvalidInputError(f"attn_mask must be a tensor, got {_describe(m)}")
    if not (m.dtype == torch.bool or m.is_floating_point()):
        raise InvalidInputError(
            f"attn_mask must be bool (True = attend) or an additive float mask, got dtype {m.dtype}")
    if m.dim() < 2 or m.dim() > 4:
        raise InvalidInputError(
            f"attn_mask must be broadcastable to (B, H, L, S) with at least (L, S), got shape {tuple(m.shape)}")
    if m.is_floating_point():
        _check_additive(m)
    return _TensorMask(m)


def _may_hold(flags: Tensor) -> bool:
    """Whether any of ``flags`` (bool) may be True: read beneath ``torch.func`` wrappers (any vmapped sample's
    counts), and True while ``torch.compile`` or ``torch.export`` traces (the graph keeps the general form for
    every input: no branch on values)."""
    return torch.compiler.is_compiling() or reads_traced(flags) or bool(_transforms.unwrapped(flags).any())


def _check_additive(m: Tensor) -> None:
    """NaN or +inf in an additive mask raises. Under ``torch.func`` transforms the values beneath the wrappers are
    read (vmap refuses a branch on a batched tensor; a per-sample mask is checked whole); while ``torch.compile``
    or ``torch.export`` traces, the graph checks its mask input when it runs (``RuntimeError`` with the same
    message), so the check is no graph break."""
    msg = "attn_mask: an additive mask may hold finite values and -inf, got NaN or +inf"
    if torch.compiler.is_compiling() or reads_traced(m):
        torch._assert_async(~(torch.isnan(m).any() | torch.isposinf(m).any()), msg)
        return
    u = _transforms.unwrapped(m)
    if bool(torch.isnan(u).any() | torch.isposinf(u).any()):
        raise InvalidInputError(msg)


def sliding_window(before: int, after: int = 0) -> Mask:
    """Query at position ``p`` sees keys at positions ``p - before ... p + after``: ``before + after + 1`` keys,
    itself included. ``sliding_window(w - 1)`` is a causal window of ``w`` keys.

    Raises:
        InvalidInputError: ``before`` or ``after`` not an int >= 0.
    """
    for name, v in (("before", before), ("after", after)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidInputError(f"sliding_window: {name} must be an int >= 0, got {v!r}")
    return _SlidingWindow(before, after)


def document(q_ids: Tensor, kv_ids: Tensor | None = None) -> Mask:
    """Packed sequences: a query attends only to keys of its own document.

    Args:
        q_ids: int ``(B, L)`` (or ``(L,)``) document id of each query.
        kv_ids: int ``(B, S)`` of each key; None = ``q_ids`` (self-attention).

    Compose with :func:`causal` (``document(ids) & causal()``) for packed
    language-model batches; pass the per-document positions as ``positions=``
    where a mechanism uses positions.

    Raises:
        InvalidInputError: not integer tensors of rank 1 or 2.
    """
    out = []
    for name, t in (("q_ids", q_ids), ("kv_ids", kv_ids)):
        if t is None:
            out.append(None)
            continue
        if not isinstance(t, Tensor) or t.is_floating_point() or t.dtype == torch.bool or t.dim() not in (1, 2):
            raise InvalidInputError(f"document: {name} must be an integer tensor (B, L) or (L,), got {_describe(t)}")
        out.append(t.long() if t.dim() == 2 else t.long()[None])
    return _Document(out[0], out[1])


def from_function(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor], *, name: str | None = None,
                  batch_dependent: bool = False, head_dependent: bool = False) -> Mask:
    """A mask from a function ``fn(b, h, q_pos, kv_pos) -> bool tensor`` (True = may attend).

    The arguments are broadcastable int64 tensors: batch index, head index,
    query position and key position (positions: see :mod:`attnkit.positions`;
    by default the index, bottom-right aligned when L != S). Use tensor
    operations only (no Python ``if`` on them), as for FlexAttention's
    ``mask_mod``. Example, a dilated causal pattern::

        m = attnkit.masks.from_function(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 2 == 0), name="dilated")

    Args:
        fn: the mask function.
        name: shown in errors and reprs (default: the function's name).
        batch_dependent / head_dependent: whether the result depends on ``b`` / ``h``
            (False lets block indices be shared across the batch / heads).

    Raises:
        InvalidInputError: ``fn`` not callable; later, when evaluated, ``fn``
            raising or returning anything but a bool tensor.
    """
    if not callable(fn):
        raise InvalidInputError(
            f"from_function: fn must be callable (b, h, q_pos, kv_pos) -> bool, got {_describe(fn)}")
    return _Function(fn, name or getattr(fn, "__name__", "mask"), bool(batch_dependent), bool(head_dependent))


def resolve(mask: Mask | None = None, *, causal: bool = False, key_padding_mask: Tensor | None = None,
            attn_mask: Tensor | None = None) -> Mask | None:
    """One mask object from ``forward``'s arguments (``mask=`` and the three shorthands), ``&``-ed.

    Raises:
        InvalidInputError: ``mask`` not a :class:`Mask`, ``causal`` not a bool, malformed tensors.
    """
    if mask is not None and not isinstance(mask, Mask):
        raise InvalidInputError(
            f"mask: expected an attnkit.masks.Mask (e.g. attnkit.masks.sliding_window(127)) or None, "
            f"got {_describe(mask)}; dense tensors go to attn_mask=")
    if not isinstance(causal, bool):
        raise InvalidInputError(f"causal: expected a bool, got {_describe(causal)}")
    parts = [] if mask is None else [mask]
    if causal:
        parts.append(_Causal())
    if key_padding_mask is not None:
        parts.append(key_padding(key_padding_mask))
    if attn_mask is not None:
        parts.append(from_tensor(attn_mask))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else _And(parts)


# ============================================================== v1 helpers
def causal_keep(L: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
    """Bool ``(L, S)``: True where query ``i`` may see key ``j`` (bottom-right aligned)."""
    i = torch.arange(L, device=device).unsqueeze(-1)
    j = torch.arange(S, device=device).unsqueeze(0)
    return j <= i + (S - L)


def split_attn_mask(attn_mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Split an ``attn_mask`` into (bool keep mask, finite additive bias).

    A bool mask gives ``(mask, None)``. A float mask gives ``(~isneginf keep,
    bias with -inf replaced by 0)``; the keep part is None when the float mask
    forbids nothing.
    """
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    forbidden = torch.isneginf(attn_mask)
    bias = attn_mask.masked_fill(forbidden, 0.0)
    keep = ~forbidden if _may_hold(forbidden) else None
    return keep, bias


def keep_mask(L: int, S: int, *, causal: bool = False, key_padding_mask: Tensor | None = None,
              attn_mask: Tensor | None = None, device: torch.device | str | None = None) -> Tensor | None:
    """Combine causal, padding and the bool part of ``attn_mask`` into one keep mask.

    Returns:
        bool tensor broadcastable to ``(B, H, L, S)`` (True = attend), or None
        when nothing is masked.
    """
    keep: Tensor | None = None
    if causal:
        keep = causal_keep(L, S, device=device)
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        keep = kpm if keep is None else keep & kpm
    bool_part, _ = split_attn_mask(attn_mask)
    if bool_part is not None:
        keep = bool_part if keep is None else keep & bool_part
    return keep


def additive(keep: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """An additive float mask: ``bias`` where ``keep``, ``-inf`` elsewhere."""
    if keep is None and bias is None:
        return None
    out = torch.zeros(keep.shape, dtype=dtype, device=keep.device) if bias is None else bias.to(dtype)
    if keep is not None:
        out = out.masked_fill(~keep, float("-inf"))
    return out
