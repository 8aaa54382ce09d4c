"""Absolute positions of queries and keys: one spelling for offsets, relative encodings and packed sequences.

``forward(..., positions=...)`` accepts:

* ``None``: key ``j`` sits at position ``j``; query ``i`` at ``i + S - L``
  (bottom-right aligned, the KV-cache convention; ``i`` when L == S).
* an ``int`` offset ``o``: queries at ``o, o + 1, ..., o + L - 1``; keys end
  with the last query (key ``j`` at ``o + L - S + j``). Streaming a chunk that
  starts at position ``o`` of a longer sequence.
* a tensor ``(L,)`` or ``(B, L)`` of integer positions, for self-attention
  (L == S): queries and keys share it. Packed sequences restart it at each
  document.
* :class:`Positions` with separate ``q`` ``(L,)``/``(B, L)`` and ``k``
  ``(S,)``/``(B, S)`` tensors (cross-attention, a cache of past keys).

Causal and sliding-window masks compare positions, not indices, so the same
mask object serves a plain sequence, a streamed chunk and a packed batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .errors import InvalidInputError

__all__ = ["Positions", "as_positions"]


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:100]


class Positions:
    """Absolute positions of queries (``q``) and keys (``k``), or an ``offset``.

    Args:
        q: int tensor ``(L,)`` or ``(B, L)``; None = derived from ``offset``.
        k: int tensor ``(S,)`` or ``(B, S)``; None = derived (see module docs).
        offset: position of the first query when ``q`` is None.

    Raises:
        InvalidInputError: a non-integer tensor, a tensor of rank > 2, a
            negative or non-int offset.
    """

    __slots__ = ("q", "k", "offset")

    def __init__(self, q: Tensor | None = None, k: Tensor | None = None, *, offset: int = 0) -> None:
        for name, t in (("q", q), ("k", k)):
            if t is None:
                continue
            if not isinstance(t, Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise InvalidInputError(
                    f"positions.{name}: expected an integer tensor (L,) or (B, L), got {_describe(t)}")
            if t.dim() not in (1, 2):
                raise InvalidInputError(
                    f"positions.{name}: expected shape (L,) or (B, L), got shape {tuple(t.shape)}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidInputError(f"positions offset: expected an int >= 0, got {offset!r}")
        self.q = None if q is None else q.long()
        self.k = None if k is None else k.long()
        self.offset = offset

    @property
    def is_default(self) -> bool:
        """True when these positions are the ones used without ``positions=`` (no tensors, offset 0)."""
        return self.q is None and self.k is None and self.offset == 0

    def cache_key(self) -> tuple[Any, ...] | None:
        """A hashable key for caches, or None when tensors are involved (not cached)."""
        if self.q is None and self.k is None:
            return ("offset", self.offset)
        return None

    def resolve(self, B: int, L: int, S: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """``(q_pos (B' , L), k_pos (B', S))`` int64 with B' in {1, B}.

        Raises:
            InvalidInputError: a tensor whose length or batch does not match.
        """
        qp, kp = self.q, self.k
        if self.is_default:  # key j at j, query i at i + S - L (bottom-right)
            qp = torch.arange(S - L, S, device=device)
            kp = torch.arange(S, device=device)
        if qp is None:
            start = self.offset
            qp = torch.arange(start, start + L, device=device)
        if kp is None:
            if self.q is not None and L == S:
                kp = qp
            else:
                last = int(qp.max()) if (self.q is not None and qp.numel()) else self.offset + L - 1
                kp = torch.arange(last - S + 1, last + 1, device=device)
        for name, t, n in (("q", qp, L), ("k", kp, S)):
            if t.shape[-1] != n:
                what = "L" if name == "q" else "S"
                raise InvalidInputError(
                    f"positions.{name}: expected {what} = {n} positions (last dim), got shape {tuple(t.shape)}")
            if t.dim() == 2 and t.shape[0] not in (1, B):
                raise InvalidInputError(
                    f"positions.{name}: expected a batch of 1 or B = {B}, got shape {tuple(t.shape)}")
        qp = qp.to(device) if device is not None else qp
        kp = kp.to(device) if device is not None else kp
        return (qp if qp.dim() == 2 else qp[None]), (kp if kp.dim() == 2 else kp[None])

    def __repr__(self) -> str:
        if self.q is None and self.k is None:
            return f"Positions(offset={self.offset})"
        parts = [f"{n}={tuple(t.shape)}" for n, t in (("q", self.q), ("k", self.k)) if t is not None]
        return f"Positions({', '.join(parts)})"


def as_positions(positions: Any, *, L: int | None = None, S: int | None = None) -> Positions | None:
    """Normalise ``forward``'s ``positions=`` argument (None, int, tensor or :class:`Positions`).

    Raises:
        InvalidInputError: any other type; a tensor given for cross-attention.
    """
    if positions is None or isinstance(positions, Positions):
        return positions
    if isinstance(positions, bool):
        raise InvalidInputError(f"positions: expected None, an int offset, a tensor or Positions, got {positions!r}")
    if isinstance(positions, int):
        return Positions(offset=positions)
    if isinstance(positions, Tensor):
        if L is not None and S is not None and L != S:
            raise InvalidInputError(
                f"positions: a single tensor gives the positions of a self-attention sequence (L == S); "
                f"got L={L}, S={S}: pass attnkit.Positions(q=..., k=...)")
        return Positions(q=positions)
    raise InvalidInputError(
        f"positions: expected None, an int offset, an integer tensor (L,)/(B, L) or attnkit.Positions, "
        f"got {_describe(positions)}")
