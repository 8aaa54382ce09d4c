"""Mask objects: constructors, composition, dense form, block index, errors."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import masks as M
from attnkit.errors import InvalidInputError
from attnkit.masks import FULL, PARTIAL, SKIP, Geometry
from attnkit.positions import Positions


def geom(B=2, H=3, L=13, S=13, positions=None):
    return Geometry(B, H, L, S, torch.device("cpu"), positions)


def expected_states(dense, bq, bk):
    """Block states computed the slow way from a dense mask."""
    B, H, L, S = dense.shape
    nq, nk = -(-L // bq), -(-S // bk)
    out = torch.empty(B, H, nq, nk, dtype=torch.int8)
    for i in range(nq):
        for j in range(nk):
            tile = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            out[:, :, i, j] = torch.where(tile.all(-1).all(-1), FULL, torch.where(tile.any(-1).any(-1), PARTIAL, SKIP))
    return out


KPM = torch.tensor([[True] * 10 + [False] * 3, [True, False] * 6 + [True]])
IDS = torch.tensor([[0] * 4 + [1] * 6 + [2] * 3, [0] * 13])

CASES = {
    "causal": (lambda: M.causal(), lambda i, j, b: j <= i),
    "window": (lambda: M.sliding_window(3), lambda i, j, b: (i - j >= 0) & (i - j <= 3)),
    "window-both": (lambda: M.sliding_window(2, 1), lambda i, j, b: (i - j <= 2) & (j - i <= 1)),
    "padding": (lambda: M.key_padding(KPM), lambda i, j, b: KPM[b, j]),
    "document": (lambda: M.document(IDS), lambda i, j, b: IDS[b, i] == IDS[b, j]),
    "causal&padding": (lambda: M.causal() & M.key_padding(KPM), lambda i, j, b: (j <= i) & KPM[b, j]),
    "window|padding": (lambda: M.sliding_window(1) | M.key_padding(KPM),
                       lambda i, j, b: ((i - j >= 0) & (i - j <= 1)) | KPM[b, j]),
    "function": (lambda: M.from_function(lambda b, h, q, kv: (q - kv) % 3 == 0, name="every-third"),
                 lambda i, j, b: (i - j) % 3 == 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dense_matches_the_definition(name):
    make, rule = CASES[name]
    d = make().dense(geom())
    B = 2
    i = torch.arange(13)[:, None]
    j = torch.arange(13)[None, :]
    for b in range(B):
        want = torch.as_tensor(rule(i, j, b)).expand(13, 13)
        assert torch.equal(d[min(b, d.shape[0] - 1), 0], want), name


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block", [(4, 4), (5, 3), (16, 16), (1, 13)])
def test_block_index_classifies_every_tile_exactly(name, block):
    m = CASES[name][0]()
    g = geom()
    dense = m.dense(g).expand(2, 1, 13, 13)
    bi = m.block_index(2, 3, 13, 13, block_size=block)
    want = expected_states(dense, *block)
    got = bi.state.expand(2, 1, *bi.state.shape[2:])
    assert torch.equal(got, want), (name, block)


def test_block_index_is_cached_per_shape_and_block_size():
    m = M.causal()
    a = m.block_index(1, 1, 100, 100, block_size=16)
    assert m.block_index(1, 1, 100, 100, block_size=16) is a
    assert m.block_index(1, 1, 100, 100, block_size=32) is not a
    assert a.num_blocks == (7, 7)
    counts, idx = a.kv_indices()
    assert counts[0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert idx[0, 0, 3, :4].tolist() == [0, 1, 2, 3]
    full_counts, _ = a.full_kv_indices()
    assert full_counts[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]  # the diagonal tiles are partial
    assert 0.5 < a.density < 0.6
    assert torch.equal(a.to_dense()[0, 0], torch.ones(100, 100, dtype=torch.bool).tril() |
                       a.to_dense()[0, 0])  # covers every allowed pair


def test_causal_is_bottom_right_aligned_for_cross_lengths():
    d = M.causal().dense(geom(L=3, S=5))[0, 0]
    assert d.tolist() == [[True, True, True, False, False], [True] * 4 + [False], [True] * 5]


def test_positions_shift_causal_and_windows():
    # packed: two documents with positions restarting at 0; a window of 1 uses positions
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    g = Geometry(1, 1, 5, 5, torch.device("cpu"), Positions(q=pos))
    d = (M.causal() & M.document(torch.tensor([[0, 0, 0, 1, 1]]))).dense(g)[0, 0]
    assert d.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                          [True, True, True, False, False], [False, False, False, True, False],
                          [False, False, False, True, True]]
    off = Geometry(1, 1, 2, 2, torch.device("cpu"), Positions(offset=7))
    assert M.causal().dense(off)[0, 0].tolist() == [[True, False], [True, True]]


def test_kinds_conjuncts_and_views():
    m = M.causal() & M.key_padding(KPM) & M.sliding_window(2)
    assert m.kinds == {"causal", "key_padding", "sliding_window"}
    assert m.is_causal and torch.equal(m.key_padding_mask, KPM)
    rest = m.without("causal", "key_padding")
    assert rest.kinds == {"sliding_window"}
    u = M.causal() | M.sliding_window(2)
    assert "union" in u.kinds and u.conjuncts() == [u] and not u.is_causal
    assert u.without("causal") is u  # the union is one atomic part
    both = u & M.causal()
    assert both.is_causal and both.without("causal") is u and both.without("union").kinds == {"causal"}
    assert (None & M.causal()).kinds == {"causal"}


def test_additive_tensor_mask_keeps_bias_and_forbids_union():
    t = torch.zeros(13, 13)
    t[0, 1] = float("-inf")
    t[2, 3] = 0.5
    m = M.from_tensor(t)
    g = geom()
    assert not bool(m.dense(g)[0, 0, 0, 1]) and bool(m.dense(g)[0, 0, 2, 3])
    assert m.bias(g, torch.float64)[0, 0, 2, 3] == 0.5 and m.has_bias
    with pytest.raises(InvalidInputError, match="cannot be part of a union"):
        m | M.causal()


@pytest.mark.parametrize("make, match", [
    (lambda: M.key_padding(torch.ones(2, 3)), "must be bool"),
    (lambda: M.key_padding(torch.ones(2, 3, 1, dtype=torch.bool)), r"shape \(B, S\)"),
    (lambda: M.from_tensor(torch.ones(3, 3, dtype=torch.long)), "bool .* or an additive float"),
    (lambda: M.from_tensor(torch.full((3, 3), float("nan"))), "NaN or \\+inf"),
    (lambda: M.sliding_window(-1), "before must be an int >= 0"),
    (lambda: M.sliding_window(2, 1.5), "after must be an int >= 0"),
    (lambda: M.document(torch.ones(2, 3)), "q_ids must be an integer tensor"),
    (lambda: M.from_function(3), "fn must be callable"),
    (lambda: M.causal().block_index(1, 1, 4, 4, block_size=0), "block_size .* int >= 1"),
])
def test_bad_mask_arguments_name_the_argument(make, match):
    with pytest.raises(InvalidInputError, match=match):
        make()


def test_mask_function_errors_are_clear():
    raising = M.from_function(lambda b, h, q, kv: 1 / 0, name="boom")
    with pytest.raises(InvalidInputError, match="'boom' raised ZeroDivisionError"):
        raising.dense(geom())
    not_bool = M.from_function(lambda b, h, q, kv: q - kv, name="ints")
    with pytest.raises(InvalidInputError, match="'ints' must return a bool tensor"):
        not_bool.block_index(1, 1, 4, 4)


def test_shape_mismatch_is_reported_at_forward():
    attn = attnkit.build("softmax")
    q = torch.randn(2, 1, 5, 4)
    with pytest.raises(InvalidInputError, match=r"key_padding_mask must have shape \(B, S\) = \(2, 5\)"):
        attn(q, q, q, mask=M.key_padding(torch.ones(2, 4, dtype=torch.bool)))
    with pytest.raises(InvalidInputError, match="document mask q_ids"):
        attn(q, q, q, mask=M.document(torch.zeros(2, 3, dtype=torch.long)))
    with pytest.raises(InvalidInputError, match="expected an attnkit.masks.Mask"):
        attn(q, q, q, mask=torch.ones(5, 5, dtype=torch.bool))


def test_large_block_index_never_materialises_the_dense_mask():
    # 64K x 64K bools would be 4 GiB; the analytic classification touches O(L / block) numbers
    m = M.causal() & M.sliding_window(255)
    bi = m.block_index(1, 1, 65536, 65536, block_size=128)
    assert bi.num_blocks == (512, 512)
    counts, _ = bi.kv_indices()
    assert counts.max().item() == 3  # a 256-key window touches at most 3 key blocks of 128


# ------------------------------------------------ analytic bands: causal & windows classified without evaluation
BANDS = {
    "window&causal": lambda S: M.sliding_window(5) & M.causal(),
    "causal&window-both": lambda S: M.causal() & M.sliding_window(4, 3),
    "two-windows": lambda S: M.sliding_window(6, 2) & M.sliding_window(3, 5),
    "empty-band": lambda S: M.sliding_window(3) & M.sliding_window(0, 0) & M.causal() & M.sliding_window(9, 0),
    "band&padding": lambda S: M.sliding_window(4) & M.causal() & M.key_padding(KPM[:, :S]),
}


@pytest.mark.parametrize("name", list(BANDS))
@pytest.mark.parametrize("L,S", [(13, 13), (9, 13), (13, 7)])
@pytest.mark.parametrize("block", [(4, 4), (5, 3), (1, 13), (16, 16), (3, 1)])
def test_band_compositions_match_element_evaluation(name, L, S, block):
    m = BANDS[name](S)
    g = geom(L=L, S=S)
    dense = m.dense(g).expand(2, 1, L, S)
    got = m.block_index(2, 3, L, S, block_size=block).state
    assert torch.equal(got.expand(2, 1, *got.shape[2:]), expected_states(dense, *block)), (name, L, S, block)
    # the same states as evaluating every element (the generic path)
    by_eval = m._blocks_by_evaluation(g, *block)
    assert torch.equal(got.expand_as(by_eval), by_eval)


@pytest.mark.parametrize("pos", [torch.arange(100, 113)[None], torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 5, 6, 7, 8, 9]]),
                                 torch.tensor([[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24]])])
def test_band_compositions_with_explicit_positions_stay_exact(pos):
    # consecutive positions (an offset) take the analytic path; gaps or restarts fall back to evaluation
    for make in BANDS.values():
        m = make(13)
        g = geom(L=13, S=13, positions=Positions(q=pos))
        dense = m.dense(g).expand(2, 1, 13, 13)
        for block in [(4, 4), (5, 3)]:
            got = m.block_index(2, 3, 13, 13, block_size=block, positions=Positions(q=pos)).state
            assert torch.equal(got.expand(2, 1, *got.shape[2:]), expected_states(dense, *block))


def test_band_composition_classifies_a_long_window_without_refining(monkeypatch):
    m = M.sliding_window(255) & M.causal()

    def no_refine(*args, **kwargs):
        raise AssertionError("the band composition should not evaluate elements")

    monkeypatch.setattr(type(m), "_refine", no_refine)
    bi = m.block_index(1, 1, 65536, 65536, block_size=64)
    st = bi.state[0, 0]
    assert int((st == PARTIAL).sum()) == 1024 + 1020   # diagonal tiles, and the far edge of full windows
    assert int((st == FULL).sum()) == 3 * 1024 - 6
    assert st[10, 10] == PARTIAL and st[10, 6] == PARTIAL and st[10, 7] == FULL and st[10, 5] == SKIP


def test_cover_bounds_every_allowed_pair():
    """``Mask._cover``: a band plus global key / query positions holding every allowed pair, checked against the
    pairs themselves; ``&`` intersects the bands and keeps each part's positions, ``|`` takes the hull."""
    inf = float("inf")

    class Keys(M.Mask):   # keys at fixed positions: no band, the positions
        kind = "function"

        def __init__(self, at):
            super().__init__()
            self.at = at

        def _keep(self, b, h, qi, ki, geom):
            return torch.isin(ki, torch.tensor(self.at)).expand(torch.broadcast_shapes(qi.shape, ki.shape))

        def _cover(self):
            return inf, -inf, frozenset(self.at), frozenset()

    win = M.sliding_window(3, 1)
    assert win._cover() == (-1, 3, frozenset(), frozenset())
    assert M.causal()._cover()[:2] == (0, inf)
    assert M.key_padding(torch.ones(1, 8, dtype=torch.bool))._cover() is None
    cases = {(win | Keys([0, 5])) & M.causal(): (0, 3, {0, 5}, set()),
             win | M.sliding_window(0, 4): (-4, 3, set(), set()),
             Keys([2]) & M.causal(): (inf, -inf, {2}, set())}
    L = 12
    qi, ki = torch.arange(L).view(1, 1, L, 1), torch.arange(L).view(1, 1, 1, L)
    geom = Geometry(1, 1, L, L, torch.device("cpu"), None)
    for mask, (lo, hi, keys, queries) in cases.items():
        assert mask._cover() == (lo, hi, frozenset(keys), frozenset(queries))
        allowed = mask._keep(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                             qi, ki, geom).expand(1, 1, L, L)
        inside = ((qi - ki >= lo) & (qi - ki <= hi)) | torch.isin(ki, torch.tensor(sorted(keys) or [-1]))
        assert allowed.any() and not (allowed & ~inside).any(), mask
    assert (win | M.causal())._cover() == (-1, inf, frozenset(), frozenset())    # unbounded: no band to attend in
