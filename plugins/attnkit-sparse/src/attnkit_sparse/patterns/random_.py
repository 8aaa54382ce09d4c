"""Block-random patterns: ``random`` (random key blocks per query block) and ``bigbird`` (ITC form).

Both are tables over blocks of ``block_size`` positions (query block
``pos(q) // block_size``, key block ``pos(k) // block_size``). Random choices
come from a counter-based hash of ``(seed, head, query block, key block)``
(:func:`attnkit_sparse.patterns._atoms.hash_scores`): reproducible from the
seed on every device, and the choice for one query block does not depend on
the sequence length beyond which key blocks exist. The key blocks that exist
are ``0 ... last``, the block of the largest query or key position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import InvalidInputError
from attnkit.masks import Geometry, Mask
from attnkit.masks import causal as causal_mask

from ..base import CAUSAL_PATTERNS, SparsePatternAttention, check_bool, check_int
from ._atoms import BlockTable, hash_scores, position_extent

__all__ = ["random_mask", "bigbird_mask", "RandomAttention", "BigBirdAttention"]


def _pick(seed: int, heads: int, qb: Tensor, nkb: int, candidates: Tensor, r: int) -> Tensor:
    """Bool ``(heads, NQB, NKB)``: for each query block the ``r`` candidates of smallest hash score."""
    dev = qb.device
    h = torch.arange(heads, device=dev).view(-1, 1, 1)
    kb = torch.arange(nkb, device=dev).view(1, 1, -1)
    score = hash_scores(seed, h, qb.view(1, -1, 1), kb) * (1 << 21) + kb
    huge = torch.iinfo(torch.int64).max
    score = torch.where(candidates, score, torch.full_like(score, huge))
    r = min(r, nkb)
    sel = torch.zeros(score.shape, dtype=torch.bool, device=dev)
    if r == 0:
        return sel
    val, idx = score.topk(r, dim=-1, largest=False)
    sel.scatter_(-1, idx, val < huge)
    return sel


class _RandomTable(BlockTable):
    def __init__(self, block_size: int, num_random: int, seed: int, causal: bool, per_head: bool):
        super().__init__(block_size)
        self.num_random, self.seed, self.causal, self.head_dependent = num_random, seed, causal, per_head

    def table(self, geom: Geometry):
        s = self.size
        qp, _ = geom.pos()
        _, hi = position_extent(geom)
        nkb = max(hi, 0) // s + 1
        qb0, qb1 = int(qp.min()) // s, int(qp.max()) // s
        qb = torch.arange(qb0, qb1 + 1, device=geom.device)
        kb = torch.arange(nkb, device=geom.device)
        cand = (kb[None, :] <= qb[:, None]) if self.causal else torch.ones(qb.numel(), nkb, dtype=torch.bool,
                                                                             device=geom.device)
        heads = geom.H if self.head_dependent else 1
        return qb0, 0, _pick(self.seed, heads, qb, nkb, cand[None], self.num_random)

    def __repr__(self) -> str:
        return f"random(block_size={self.size}, num_random={self.num_random}, seed={self.seed})"


class _BigBirdTable(BlockTable):
    def __init__(self, block_size: int, num_random: int, num_global: int, num_window: int, seed: int,
                 per_head: bool):
        super().__init__(block_size)
        self.num_random, self.num_global, self.num_window, self.seed = num_random, num_global, num_window, seed
        self.head_dependent = per_head

    def table(self, geom: Geometry):
        s = self.size
        qp, _ = geom.pos()
        _, hi = position_extent(geom)
        nkb = max(hi, 0) // s + 1
        qb0, qb1 = int(qp.min()) // s, int(qp.max()) // s
        dev = geom.device
        qb = torch.arange(qb0, qb1 + 1, device=dev)[:, None]
        kb = torch.arange(nkb, device=dev)[None, :]
        first, last = (self.num_global + 1) // 2, self.num_global // 2

        def is_global(x: Tensor) -> Tensor:
            return (x < first) | (x >= nkb - last)

        window = (kb - qb).abs() <= (self.num_window - 1) // 2
        fixed = is_global(qb) | is_global(kb) | window
        heads = geom.H if self.head_dependent else 1
        rand = _pick(self.seed, heads, qb.view(-1), nkb, ~fixed[None], self.num_random)
        return qb0, 0, fixed[None] | rand

    def __repr__(self) -> str:
        return (f"bigbird(block_size={self.size}, num_random={self.num_random}, num_global={self.num_global}, "
                f"num_window={self.num_window}, seed={self.seed})")


def random_mask(block_size: int, num_random: int, seed: int = 0, causal: bool = False,
                per_head: bool = False) -> Mask:
    """Each query block sees ``num_random`` key blocks drawn from ``seed`` (causal: among blocks up to its own)."""
    m = _RandomTable(check_int("block_size", block_size), check_int("num_random", num_random),
                     check_int("seed", seed, 0), causal, per_head)
    return m & causal_mask() if causal else m


def bigbird_mask(block_size: int = 64, num_random: int = 3, num_global: int = 2, num_window: int = 3,
                 seed: int = 0, per_head: bool = False) -> Mask:
    """BigBird-ITC on blocks (see :class:`BigBirdAttention`)."""
    nw = check_int("num_window", num_window)
    if nw % 2 == 0:
        raise InvalidInputError(
            f"num_window: expected an odd int >= 1 (the query's block and (num_window - 1) / 2 blocks on each "
            f"side), got {num_window!r}")
    return _BigBirdTable(check_int("block_size", block_size), check_int("num_random", num_random, 0),
                         check_int("num_global", num_global, 0), nw, check_int("seed", seed, 0), per_head)


class RandomAttention(SparsePatternAttention):
    """Random block attention (BigBird's random part): each query block sees ``num_random`` random key blocks.

    Blocks are ``block_size`` positions from position 0. For every query
    block the ``num_random`` key blocks with the smallest hash score of
    ``(seed, head, query block, key block)`` are chosen among the blocks that
    exist (causal: among blocks up to the query's own, and then only earlier
    keys). Keys per query: ``num_random · block_size`` (fewer when fewer blocks
    exist or, causal, in the query's own block). Reproducible from ``seed``;
    ``per_head=True`` draws per head.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        block_size: positions per block (an int >= 1). Default 64.
        num_random: random key blocks per query block (an int >= 1). Default 3 (BigBird's r).
        seed: the draw (an int >= 0); the same seed gives the same blocks. Default 0.
        per_head: draw different blocks for each head. Default False.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"block_size": {"minimum": 1}, "num_random": {"minimum": 1}, "seed": {"minimum": 0}}

    def __init__(self, *, block_size: int = 64, num_random: int = 3, seed: int = 0, per_head: bool = False,
                 num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.block_size = check_int("block_size", block_size)
        self.num_random = check_int("num_random", num_random)
        self.seed = check_int("seed", seed, 0)
        self.per_head = check_bool("per_head", per_head)

    def _pattern(self, causal: bool) -> Mask:
        return random_mask(self.block_size, self.num_random, self.seed, causal, self.per_head)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block_size={self.block_size}, num_random={self.num_random}, "
                f"seed={self.seed}, per_head={self.per_head}")


class BigBirdAttention(SparsePatternAttention):
    """BigBird, ITC form (Zaheer et al. 2020): window + global + random blocks, on blocks of ``block_size``.

    With key blocks ``0 ... last``: the global blocks are the first
    ``ceil(num_global / 2)`` and the last ``floor(num_global / 2)`` (the
    paper's 2: the first and the last); a global query block sees every key,
    every query sees the global key blocks; other query blocks see the
    ``num_window`` blocks centred on their own and ``num_random`` random
    blocks drawn (from ``seed``) among the rest. Keys per query of a
    non-global block: ``(num_window + num_global + num_random) · block_size``
    when that many blocks exist. No causal form (the last block is global).

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        block_size: positions per block (an int >= 1). Default 64 (paper).
        num_random: random key blocks per query block (an int >= 0). Default 3 (paper).
        num_global: global blocks, first and last (an int >= 0). Default 2 (paper).
        num_window: window blocks centred on the query's block (an odd int >= 1). Default 3 (paper).
        seed: the random draw (an int >= 0). Default 0.
        per_head: draw different random blocks for each head. Default False.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"block_size": {"minimum": 1}, "num_random": {"minimum": 0}, "num_global": {"minimum": 0},
                          "num_window": {"minimum": 1}, "seed": {"minimum": 0}}
    has_causal_form = False
    refusal_reasons = {
        "causal": ("BigBird-ITC has no causal form (its last block is global: it sees and is seen by every "
                   "position); sparse patterns with a causal form: " + ", ".join(CAUSAL_PATTERNS)),
    }

    def __init__(self, *, block_size: int = 64, num_random: int = 3, num_global: int = 2, num_window: int = 3,
                 seed: int = 0, per_head: bool = False, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.block_size = check_int("block_size", block_size)
        self.num_random = check_int("num_random", num_random, 0)
        self.num_global = check_int("num_global", num_global, 0)
        self.num_window = check_int("num_window", num_window)
        self.seed = check_int("seed", seed, 0)
        self.per_head = check_bool("per_head", per_head)
        bigbird_mask(self.block_size, self.num_random, self.num_global, self.num_window, self.seed)  # checks

    def _pattern(self, causal: bool) -> Mask:
        return bigbird_mask(self.block_size, self.num_random, self.num_global, self.num_window, self.seed,
                            self.per_head)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block_size={self.block_size}, num_random={self.num_random}, "
                f"num_global={self.num_global}, num_window={self.num_window}, seed={self.seed}")
