"""``bp-transformer``: the binary-partition pattern of BP-Transformer (Ye et al. 2019), on tokens.

BPT builds a binary tree over the sequence: leaves are tokens, a node at
level ``l`` stands for a span of ``2^l`` tokens, and each token attends to
``k`` nodes on each side per level: fine (single tokens) nearby, coarser
spans further away, O(k·log L) contexts per token.

What attnkit implements is that pattern **on tokens only**: the span node of
the level-``l`` span ``[s·2^l, (s + 1)·2^l)`` is represented by its first
token ``s·2^l``. Query ``i`` sees key ``j`` when, for some level
``0 <= l <= levels`` with ``2^l`` dividing ``j``, the spans
``j >> l`` and ``i >> l`` are at most ``k`` apart. Level 0 is the ``2k + 1``
tokens around the query (itself included); level ``l`` adds the first token
of each of the ``2k + 1`` nearest level-``l`` spans. At most
``(2k + 1)·(levels + 1)`` keys per query, about ``2k·log2(L)``.

Not modelled: BPT's span nodes are extra positions whose values are computed
from their leaves (a learned summary of the range); a mask over the input
tokens cannot create them, so a far range is represented by one of its tokens.
"""

from __future__ import annotations

import torch

from attnkit.masks import Mask, _states
from attnkit.masks import causal as causal_mask

from ..base import SparsePatternAttention, check_int
from ._atoms import Atom, contiguous, tile_ranges

__all__ = ["bp_mask", "BPTransformerAttention"]

_MAX_LEVEL = 62


class _BinaryPartition(Atom):
    def __init__(self, k: int, levels: int | None):
        super().__init__()
        self.k, self.levels = k, _MAX_LEVEL if levels is None else min(levels, _MAX_LEVEL)

    def _allow(self, h, qpos, kpos, geom):
        low = kpos & (-kpos)
        tz = torch.where(low > 0, torch.log2(low.clamp(min=1).double()).round().long(),
                         torch.full_like(kpos, _MAX_LEVEL))
        lvl = tz.clamp(max=self.levels)
        return ((kpos >> lvl) - (qpos >> lvl)).abs() <= self.k

    def _blocks(self, geom, bq, bk):
        start = contiguous(geom)
        if start is None:
            return self._blocks_by_evaluation(geom, bq, bk)
        qlo, qhi, klo, khi = tile_ranges(geom, bq, bk, *start)
        k = self.k
        full = (qhi - klo <= k) & (qlo - khi >= -k)
        any_ = torch.zeros(full.shape, dtype=torch.bool, device=full.device)
        top = max(int(qhi.abs().max()), int(khi.abs().max()), 1).bit_length() + 1
        for lvl in range(min(self.levels, top) + 1):
            P = 1 << lvl
            lo = torch.maximum(klo, ((qlo >> lvl) - k) * P)
            hi = torch.minimum(khi, ((qhi >> lvl) + k) * P)
            any_ |= (lo <= hi) & (torch.div(hi, P, rounding_mode="floor") * P >= lo)
        if self.levels > top:  # key 0 represents the root span: everyone sees it
            any_ |= (klo <= 0) & (khi >= 0)
        return _states(full, any_)[None, None].contiguous()

    def __repr__(self) -> str:
        return f"binary_partition(k={self.k}, levels={self.levels})"


def bp_mask(k: int = 4, levels: int | None = None, causal: bool = False) -> Mask:
    """The token-level binary-partition pattern (module docs); causal: ``& causal()``."""
    m = _BinaryPartition(check_int("k", k), None if levels is None else check_int("levels", levels, 0))
    return m & causal_mask() if causal else m


class BPTransformerAttention(SparsePatternAttention):
    """BP-Transformer's binary-partition pattern on tokens: fine near, coarse far (see the module docs).

    Query ``i`` sees key ``j`` when ``|(j >> l) - (i >> l)| <= k`` at the
    level ``l = min(trailing zeros of j, levels)``: the ``2k + 1`` tokens
    around it (itself included) and, per coarser level, the first token of
    each of the ``2k + 1`` nearest spans of ``2^l`` tokens. Keys per query: at
    most ``(2k + 1)·(levels + 1)``, about ``2k·log2(L)``. Causal: ``& j <= i``
    (the paper's language-model setting). BPT's span nodes (learned range
    summaries) are not modelled: a far span is represented by its first token.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        k: spans (tokens at level 0) on each side per level (an int >= 1). Default 4.
        levels: the coarsest level (an int >= 0); None: as many as the sequence needs. Default None.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"k": {"minimum": 1}, "levels": {"minimum": 0}}

    def __init__(self, *, k: int = 4, levels: int | None = None, num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.k = check_int("k", k)
        self.levels = None if levels is None else check_int("levels", levels, 0)

    def _pattern(self, causal: bool) -> Mask:
        return bp_mask(self.k, self.levels, causal)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.k}, levels={self.levels}"
