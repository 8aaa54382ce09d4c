"""Sparse Transformer factorised patterns (Child et al. 2019): ``strided`` and ``fixed``, merged form.

The paper defines two index sets per query ``i`` (keys ``j``), stride ``l``:

* strided: ``A1 = {j : i - l <= j <= i}`` (the ``l`` previous positions and
  itself), ``A2 = {j : (i - j) mod l = 0}`` (every ``l``-th position back);
* fixed: ``A1 = {j : floor(j / l) = floor(i / l)}`` (its block of ``l``),
  ``A2 = {j : j mod l in {l - c, ..., l - 1}}`` (the last ``c`` positions of
  every block: the "summary" columns).

The paper splits A1 and A2 across heads or layers, or merges them in one
head: ``heads="merged"`` (default) gives every head ``A1 ∪ A2``;
``heads="split"`` gives even heads A1 and odd heads A2 (interleaved heads).
Causal forms add ``j <= i`` (the paper's autoregressive setting);
bidirectional forms drop it (strided: ``|i - j| <= l`` or ``(i - j) mod l = 0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import InvalidInputError
from attnkit.masks import Mask
from attnkit.masks import causal as causal_mask

from ..base import SparsePatternAttention, check_int
from ._atoms import Atom, BlockBand, KeyResidue, PeriodicBand

__all__ = ["strided_mask", "fixed_mask", "StridedAttention", "FixedAttention"]


class _Strided(Atom):
    """``d = pos(q) - pos(k)``: ``-after <= d <= before`` (A1) or ``d mod stride = 0`` (A2), classified as one set."""

    def __init__(self, stride: int, before: int, after: int):
        super().__init__()
        self.stride, self.before, self.after = stride, before, after

    def _allow(self, h, qpos, kpos, geom):
        d = qpos - kpos
        return ((d <= self.before) & (d >= -self.after)) | (d % self.stride == 0)

    def _tiles(self, qlo, qhi, klo, khi, geom):
        s, lo, hi = self.stride, -self.after, self.before
        dlo, dhi = qlo - khi, qhi - klo  # every difference in between occurs in the tile
        any_ = ((dhi >= lo) & (dlo <= hi)) | (torch.div(dhi, s, rounding_mode="floor") * s >= dlo)

        def columns_only(a: Tensor, b: Tensor) -> Tensor:  # [a, b] (maybe empty) holds multiples of s only
            return (a > b) | (s == 1) | ((a == b) & (a % s == 0))

        full = columns_only(dlo, torch.minimum(dhi, torch.full_like(dhi, lo - 1))) & \
            columns_only(torch.maximum(dlo, torch.full_like(dlo, hi + 1)), dhi)
        return full, any_

    def __repr__(self) -> str:
        return f"strided(stride={self.stride}, before={self.before}, after={self.after})"


class _SplitHeads(Atom):
    """Even heads ``a1``, odd heads ``a2`` (the paper's interleaved heads)."""

    head_dependent = True

    def __init__(self, a1: Atom, a2: Atom):
        super().__init__()
        self.a1, self.a2 = a1, a2

    def _allow(self, h, qpos, kpos, geom):
        return torch.where(h % 2 == 0, self.a1._allow(h, qpos, kpos, geom), self.a2._allow(h, qpos, kpos, geom))

    def _tiles(self, qlo, qhi, klo, khi, geom):
        even = (torch.arange(geom.H, device=qlo.device) % 2 == 0).view(-1, 1, 1)
        f1, y1 = self.a1._tiles(qlo, qhi, klo, khi, geom)
        f2, y2 = self.a2._tiles(qlo, qhi, klo, khi, geom)
        return torch.where(even, f1, f2), torch.where(even, y1, y2)

    def __repr__(self) -> str:
        return f"split_heads(even={self.a1!r}, odd={self.a2!r})"


def _check_heads(heads: str) -> str:
    if heads not in ("merged", "split"):
        raise InvalidInputError(f"heads: expected 'merged' (A1 ∪ A2 in every head) or 'split' (A1 in even heads, A2 "
                                f"in odd heads), got {heads!r}")
    return heads


def strided_mask(stride: int, causal: bool = False, heads: str = "merged") -> Mask:
    """``A1 ∪ A2`` of the strided pattern (module docs), or A1 / A2 in even / odd heads; causal: ``& causal()``."""
    s = check_int("stride", stride)
    if _check_heads(heads) == "merged":
        m: Mask = _Strided(s, s, 0 if causal else s)
    else:
        m = _SplitHeads(PeriodicBand(1, s, 0 if causal else s, name="strided-A1"),
                        PeriodicBand(s, None, None, name="strided-A2"))
    return m & causal_mask() if causal else m


def fixed_mask(stride: int, c: int, causal: bool = False, heads: str = "merged") -> Mask:
    """``A1 ∪ A2`` of the fixed pattern (module docs), or A1 / A2 in even / odd heads; causal: ``& causal()``."""
    s = check_int("stride", stride)
    c = check_int("c", c)
    if c > s:
        raise InvalidInputError(f"c: expected an int in [1, stride] = [1, {s}] (summary positions per block), got {c}")
    a1, a2 = BlockBand(s, 0, 0, name="fixed-A1"), KeyResidue(s, s - c, s - 1, name="fixed-A2")
    m = a1 | a2 if _check_heads(heads) == "merged" else _SplitHeads(a1, a2)
    return m & causal_mask() if causal else m


class StridedAttention(SparsePatternAttention):
    """Sparse Transformer, strided pattern (merged head): the ``stride`` previous positions and every ``stride``-th.

    Query ``i`` sees key ``j`` when ``0 <= i - j <= stride`` or ``(i - j) mod
    stride = 0`` (causal); bidirectional: ``|i - j| <= stride`` or
    ``(i - j) mod stride = 0``. Keys per query, causal: ``stride + 1``
    (itself included) plus ``floor(i / stride) - 1`` column keys further back;
    about ``stride + L / stride``, O(L·sqrt(L)) in all at ``stride ~ sqrt(L)``.
    The causal form streams exactly, but every past key stays visible to a
    later query through the column set A2, so its state is the whole KV cache.

    With ``heads="split"`` even heads see A1 only and odd heads A2 only.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        stride: the paper's l (an int >= 1). Default 128.
        heads: "merged" (every head sees A1 ∪ A2) or "split" (even heads A1, odd heads A2). Default "merged".
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"stride": {"minimum": 1}, "heads": {"choices": ("merged", "split")}}
    streams = True

    def __init__(self, *, stride: int = 128, heads: str = "merged", num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.stride = check_int("stride", stride)
        self.heads = _check_heads(heads)

    def _pattern(self, causal: bool) -> Mask:
        return strided_mask(self.stride, causal, self.heads)

    def _still_visible(self, kpos: Tensor, next_pos: int) -> Tensor:
        return kpos >= 0  # the column set A2 reaches every earlier key: nothing can be dropped

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stride={self.stride}, heads={self.heads!r}"


class FixedAttention(SparsePatternAttention):
    """Sparse Transformer, fixed pattern (merged head): its block of ``stride`` and the last ``c`` of every block.

    Query ``i`` sees key ``j`` when ``floor(j / stride) = floor(i / stride)``
    or ``j mod stride >= stride - c`` (causal: and ``j <= i``). Keys per
    query: ``stride`` (causal: ``i mod stride + 1``) plus ``c`` per other
    block (causal: per earlier block). The causal form streams exactly with a
    state of the current block and the ``c`` summary keys of every finished
    block (``c / stride`` of the positions seen: it grows with the sequence,
    because later queries still see those columns).

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        stride: the paper's l, the block length (an int >= 1). Default 128.
        c: summary positions at the end of every block (an int in [1, stride]). Default 8.
        heads: "merged" (every head sees A1 ∪ A2) or "split" (even heads A1, odd heads A2). Default "merged".
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"stride": {"minimum": 1}, "c": {"minimum": 1}, "heads": {"choices": ("merged", "split")}}
    streams = True

    def __init__(self, *, stride: int = 128, c: int = 8, heads: str = "merged", num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.stride = check_int("stride", stride)
        self.c = check_int("c", c)
        self.heads = _check_heads(heads)
        fixed_mask(self.stride, self.c)  # checks c <= stride

    def _pattern(self, causal: bool) -> Mask:
        return fixed_mask(self.stride, self.c, causal, self.heads)

    def _still_visible(self, kpos: Tensor, next_pos: int) -> Tensor:
        s = self.stride
        return (kpos // s == next_pos // s) | (kpos % s >= s - self.c)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stride={self.stride}, c={self.c}, heads={self.heads!r}"
