"""Block indices computed analytically equal the element-wise truth, tile by tile, for every pattern."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnkit
from attnkit.masks import FULL, SKIP, Geometry, _reduce_blocks
from attnkit.positions import Positions
from attnkit_sparse.patterns import (
    axial_mask,
    bigbird_mask,
    block_local_mask,
    bp_mask,
    dilated_mask,
    fixed_mask,
    global_mask,
    local_2d_mask,
    longformer_mask,
    random_mask,
    strided_mask,
)

PATTERNS = {
    "dilated": lambda c: dilated_mask(4, 3, c),
    "dilated-per-head": lambda c: dilated_mask(3, (1, 2), c),
    "block-local": lambda c: block_local_mask(5, c, True),
    "global": lambda c: global_mask(3, (0, 4, 17), c),
    "random": lambda c: random_mask(4, 2, 3, c, True),
    "longformer": lambda c: longformer_mask(4, (0,), c, 2),
    "bigbird": lambda c: bigbird_mask(4, 2, 2, 3, 5),
    "strided": lambda c: strided_mask(5, c),
    "fixed": lambda c: fixed_mask(6, 2, c),
    "strided-split": lambda c: strided_mask(4, c, "split"),
    "fixed-split": lambda c: fixed_mask(5, 2, c, "split"),
    "local-2d": lambda c: local_2d_mask((3, 3), None, c),
    "local-2d-cols": lambda c: local_2d_mask((2, 3), 7, c),
    "axial": lambda c: axial_mask(None, "both", c),
    "bp": lambda c: bp_mask(2, None, c),
    "bp-levels": lambda c: bp_mask(1, 3, c),
}


def truth(m, L, S, bs, positions=None):
    return _reduce_blocks(m.dense(Geometry(1, 2, L, S, torch.device("cpu"), positions)), L, S, *bs)


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_block_states_are_exact_or_conservative(name):
    shapes = ((37, 37), (20, 33), (33, 20))
    for causal, (L, S), bs in itertools.product((False, True), shapes, ((4, 4), (8, 5), (16, 16))):
        if name == "bigbird" and causal:
            continue
        m = PATTERNS[name](causal)
        got = m.block_index(1, 2, L, S, block_size=bs).state
        got, want = torch.broadcast_tensors(got, truth(m, L, S, bs))
        where = f"{name} causal={causal} L={L} S={S} block={bs}"
        assert not bool(((got == FULL) & (want != FULL)).any()), f"{where}: a FULL tile holds a masked pair"
        assert not bool(((got == SKIP) & (want != SKIP)).any()), f"{where}: a SKIP tile holds an allowed pair"
        if not name.startswith("bp"):  # bp marks truly full tiles PARTIAL beyond its level-0 window (documented)
            assert got.equal(want), f"{where}: not tight"


def test_offset_and_explicit_positions():
    m = strided_mask(3, True)
    for pos in (Positions(offset=5), Positions(q=torch.arange(3, 20), k=torch.arange(0, 20))):
        L = 17
        S = 20
        got = m.block_index(1, 1, L, S, block_size=4, positions=pos).state
        assert got.equal(truth(m, L, S, (4, 4), pos).expand_as(got))


def test_block_index_at_64k_is_cheap():
    """Every pattern's 64K x 64K index, one at a time, without an (L, S) tensor (timed in the report, not here)."""
    L = 1 << 16
    for name in ("local", "longformer", "bigbird", "bp-transformer"):
        bi = attnkit.build(name).pattern_mask(L, L, causal=False).block_index(1, 1, L, L)
        assert bi.state.shape[-2:] == (L // 64, L // 64) and bi.density < 0.05
