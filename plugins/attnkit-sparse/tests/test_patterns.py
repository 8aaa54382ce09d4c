"""Each pattern against its paper's definition, written out independently (Python loops or by hand)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import dense

import attnkit
from attnkit.masks import from_function
from attnkit_sparse.patterns import (
    axial_mask,
    bigbird_mask,
    block_local_mask,
    bp_mask,
    dilated_mask,
    fixed_mask,
    global_mask,
    local_2d_mask,
    local_mask,
    longformer_mask,
    random_mask,
    strided_mask,
)


def brute(L, rule, S=None):
    S = L if S is None else S
    return torch.tensor([[bool(rule(i, j)) for j in range(S)] for i in range(L)])


def rows(text):
    """A hand-written pattern: one row per query, '1' = may attend."""
    return torch.tensor([[c == "1" for c in r] for r in text.split()])


# ---------------------------------------------------------------- local
@pytest.mark.parametrize("window", [1, 2, 4, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_local_sees_exactly_window_keys_itself_included(window, causal):
    L = 16
    m = dense(local_mask(window, causal), L)[0, 0]
    counts = m.sum(-1)
    before, after = (window - 1, 0) if causal else (window // 2, (window - 1) // 2)
    interior = range(before, L - after)
    assert all(int(counts[i]) == window for i in interior)
    assert bool(m.diagonal().all())  # itself counted
    assert bool((counts <= window).all())
    if causal:
        assert not bool(m.triu(1).any())


def test_local_bidirectional_split_is_documented_one():
    m = dense(local_mask(4), 8)[0, 0]
    assert rows("11000000 11100000 11110000 01111000 00111100 00011110 00001111 00000111").equal(m)


@pytest.mark.parametrize("causal", [False, True])
def test_local_with_window_covering_the_sequence_is_softmax(qkv, causal):
    q, k, v = qkv(11)
    got = attnkit.build("local", window=40, backend="torch")(q, k, v, causal=causal)
    want = attnkit.build("softmax")(q, k, v, causal=causal)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_local_equals_softmax_with_the_same_window(qkv):
    q, k, v = qkv(13)
    got = attnkit.build("local", window=5, backend="torch")(q, k, v, causal=True)
    want = attnkit.build("softmax")(q, k, v, mask=attnkit.masks.sliding_window(4), causal=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


# -------------------------------------------------------------- dilated / block-local
@pytest.mark.parametrize("causal", [False, True])
def test_dilated_keys_are_window_steps_of_dilation(causal):
    w, d, L = 3, 2, 14
    lo, hi = (-(w - 1), 0) if causal else (-(w // 2), (w - 1) // 2)
    want = brute(L, lambda i, j: any(j == i + s * d for s in range(lo, hi + 1)))
    assert dense(dilated_mask(w, d, causal), L)[0, 0].equal(want)


def test_dilated_per_head():
    m = dense(dilated_mask(2, (1, 3), True), 8, H=2)
    assert m[0, 0].equal(brute(8, lambda i, j: j in (i, i - 1)))
    assert m[0, 1].equal(brute(8, lambda i, j: j in (i, i - 3)))


@pytest.mark.parametrize("previous", [False, True])
def test_block_local(previous):
    b, L = 3, 10
    want = brute(L, lambda i, j: j // b == i // b or (previous and j // b == i // b - 1))
    assert dense(block_local_mask(b, False, previous), L)[0, 0].equal(want)
    assert dense(block_local_mask(b, True, previous), L)[0, 0].equal(want & brute(L, lambda i, j: j <= i))


# -------------------------------------------------------------- global / longformer
@pytest.mark.parametrize("make", [lambda c: global_mask(3, (0, 6), c), lambda c: longformer_mask(4, (0, 6), c)])
def test_global_tokens_see_everyone_and_are_seen_by_everyone(make):
    L = 12
    m = dense(make(False), L)[0, 0]
    for g in (0, 6):
        assert bool(m[g].all()) and bool(m[:, g].all())
    assert not bool(m[3].all())  # an ordinary token does not
    c = dense(make(True), L)[0, 0]
    causal = brute(L, lambda i, j: j <= i)
    assert not bool((c & ~causal).any())  # the causal form: the window before the query, globals, no future
    assert bool(c[6, :7].all()) and bool(c[6:, 0].all()) and bool(c[6:, 6].all())


def test_longformer_window_is_w_plus_one_keys():
    w, L = 4, 16
    m = dense(longformer_mask(w, (0,), False), L)[0, 0]
    assert int(m[8].sum()) == w + 1 + 1  # w/2 each side, itself, and the global token 0
    c = dense(longformer_mask(w, (0,), True), L)[0, 0]
    assert int(c[8].sum()) == w + 1 + 1


def test_longformer_defaults_are_the_papers():
    a = attnkit.build("longformer")
    assert a.window == 512 and a.dilation == 1 and a.global_positions == (0,)


# -------------------------------------------------------------- random / bigbird
def test_random_is_reproducible_from_its_seed_and_differs_across_seeds():
    L = 64
    a = dense(random_mask(4, 2, seed=1), L)
    assert a.equal(dense(random_mask(4, 2, seed=1), L))
    assert not a.equal(dense(random_mask(4, 2, seed=2), L))
    # every query block sees exactly num_random whole key blocks
    blocks = a[0, 0].view(16, 4, 16, 4).any(-1).any(1)
    assert bool((blocks.sum(-1) == 2).all())
    assert bool(a[0, 0].view(16, 4, 16, 4).all(-1).all(1)[blocks].all())


def test_random_per_head_and_causal():
    m = dense(random_mask(2, 2, seed=0, per_head=True), 32, H=3)
    assert not (m[0, 0].equal(m[0, 1]) and m[0, 1].equal(m[0, 2]))
    c = dense(random_mask(2, 2, seed=0, causal=True), 32)[0, 0]
    assert not bool(c.triu(1).any())


def test_random_choice_does_not_depend_on_the_length():
    short, long = dense(random_mask(2, 2, 5, causal=True), 20)[0, 0], dense(random_mask(2, 2, 5, causal=True), 40)[0, 0]
    assert short.equal(long[:20, :20])


def _bigbird_blocks(m, b):
    n = m.shape[-1] // b
    return m[0, 0].view(n, b, n, b).any(-1).any(1)


def test_bigbird_structure_and_seed():
    b, n = 2, 12
    m = dense(bigbird_mask(b, num_random=2, num_global=2, num_window=3, seed=4), b * n)
    blk = _bigbird_blocks(m, b)
    assert bool(blk[0].all()) and bool(blk[-1].all()) and bool(blk[:, 0].all()) and bool(blk[:, -1].all())
    for qb in range(1, n - 1):
        window = {max(0, qb - 1), qb, min(n - 1, qb + 1)}
        chosen = set(blk[qb].nonzero().view(-1).tolist())
        assert window | {0, n - 1} <= chosen
        assert len(chosen - window - {0, n - 1}) == 2  # the random blocks, outside window and globals
    assert m.equal(dense(bigbird_mask(b, 2, 2, 3, seed=4), b * n))
    assert not m.equal(dense(bigbird_mask(b, 2, 2, 3, seed=5), b * n))


def test_bigbird_defaults_are_the_papers():
    a = attnkit.build("bigbird")
    assert (a.block_size, a.num_random, a.num_global, a.num_window) == (64, 3, 2, 3)


# -------------------------------------------------------------- Sparse Transformer
def test_strided_matches_the_paper_on_a_hand_written_example():
    # l = 3, causal: A1 = {max(0, i - 3) .. i}, A2 = {j <= i : (i - j) mod 3 = 0}
    want = rows("""
        10000000
        11000000
        11100000
        11110000
        01111000
        00111100
        10011110
        01001111
    """)
    assert dense(strided_mask(3, True), 8)[0, 0].equal(want)


def test_fixed_matches_the_paper_on_a_hand_written_example():
    # l = 4, c = 1, causal: A1 = same block of 4, A2 = {j : j mod 4 = 3}
    want = rows("""
        10000000
        11000000
        11100000
        11110000
        00011000
        00011100
        00011110
        00011111
    """)
    assert dense(fixed_mask(4, 1, True), 8)[0, 0].equal(want)
    bidir = dense(fixed_mask(4, 1, False), 8)[0, 0]
    assert bidir.equal(brute(8, lambda i, j: j // 4 == i // 4 or j % 4 == 3))


@pytest.mark.parametrize("causal", [False, True])
def test_split_heads_give_a1_to_even_heads_and_a2_to_odd_heads(causal):
    L, s = 12, 3
    before_ok = (lambda i, j: j <= i) if causal else (lambda i, j: True)
    st = dense(strided_mask(s, causal, heads="split"), L, H=4)[0]
    assert st[0].equal(st[2]) and st[1].equal(st[3])
    assert st[0].equal(brute(L, lambda i, j: -(0 if causal else s) <= i - j <= s and before_ok(i, j)))
    assert st[1].equal(brute(L, lambda i, j: (i - j) % s == 0 and before_ok(i, j)))
    fx = dense(fixed_mask(4, 1, causal, heads="split"), L, H=2)[0]
    assert fx[0].equal(brute(L, lambda i, j: i // 4 == j // 4 and before_ok(i, j)))
    assert fx[1].equal(brute(L, lambda i, j: j % 4 == 3 and before_ok(i, j)))
    merged = dense(strided_mask(s, causal), L)[0, 0]
    assert merged.equal(st[0] | st[1])


def test_strided_bidirectional_definition():
    assert dense(strided_mask(3, False), 10)[0, 0].equal(brute(10, lambda i, j: abs(i - j) <= 3 or (i - j) % 3 == 0))


# -------------------------------------------------------------- grids
def test_axial_is_the_union_of_row_and_column():
    want = rows("""
        111100100
        111010010
        111001001
        100111100
        010111010
        001111001
        100100111
        010010111
        001001111
    """)
    assert want.equal(brute(9, lambda i, j: i // 3 == j // 3 or i % 3 == j % 3))
    m = dense(axial_mask((3, 3)), 9)[0, 0]
    assert m.equal(want)
    assert m.equal(dense(axial_mask((3, 3), "row"), 9)[0, 0] | dense(axial_mask((3, 3), "column"), 9)[0, 0])
    assert int(m[4].sum()) == 3 + 3 - 1
    assert dense(axial_mask(None, causal=True), 9)[0, 0].equal(want & brute(9, lambda i, j: j <= i))


@pytest.mark.parametrize("causal", [False, True])
def test_local_2d_window(causal):
    R, C, (h, w) = 5, 6, (3, 3)
    rb, ra = (h - 1, 0) if causal else (h // 2, (h - 1) // 2)

    def rule(i, j):
        dr, dc = i // C - j // C, i % C - j % C
        ok = -ra <= dr <= rb and -((w - 1) // 2) <= dc <= w // 2
        return ok and (j <= i or not causal)

    m = dense(local_2d_mask((h, w), (R, C), causal), R * C)[0, 0]
    assert m.equal(brute(R * C, rule))
    centre = 2 * C + 2
    assert int(m[centre].sum()) == ((h - 1) * w + w // 2 + 1 if causal else h * w)


def test_default_grid_is_square():
    a = attnkit.build("axial")
    assert dense(a.pattern_mask(16, 16), 16)[0, 0].equal(dense(axial_mask((4, 4)), 16)[0, 0])


# -------------------------------------------------------------- BP
@pytest.mark.parametrize("k,levels", [(1, None), (2, None), (1, 2)])
def test_bp_transformer_binary_partition(k, levels):
    L = 40
    top = levels if levels is not None else 62

    def rule(i, j):
        return any(j % (1 << lvl) == 0 and abs((j >> lvl) - (i >> lvl)) <= k for lvl in range(min(top, 8) + 1)) \
            or (levels is None and j == 0)

    m = dense(bp_mask(k, levels), L)[0, 0]
    assert m.equal(brute(L, rule))
    # fine near, coarse far: every key within k, few far ones
    assert bool(brute(L, lambda i, j: abs(i - j) <= k).le(m).all())
    assert int(m.sum(-1).max()) <= (2 * k + 1) * (math.ceil(math.log2(L)) + 1)


# -------------------------------------------------------------- block-sparse
def test_block_sparse_runs_a_third_party_mask_function(qkv):
    q, k, v = qkv(19)
    m = from_function(lambda b, h, qp, kp: (qp - kp) % 4 == 0, name="every-fourth")
    got = attnkit.build("block-sparse", backend="torch")(q, k, v, mask=m, causal=True)
    want = attnkit.build("softmax")(q, k, v, mask=m, causal=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert attnkit.build("block-sparse").pattern_mask(8, 8) is None


def test_additive_bias_is_exact_on_the_dense_path(qkv):
    q, k, v = qkv(9)
    bias = torch.randn(9, 9, dtype=torch.float64)
    got = attnkit.build("local", window=3, backend="torch")(q, k, v, attn_mask=bias)
    keep = dense(local_mask(3), 9)[0, 0]
    want = attnkit.build("softmax")(q, k, v, attn_mask=bias.masked_fill(~keep, float("-inf")))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_repeated_calls_hand_the_engine_the_same_mask_object():
    """forward makes a new causal mask per call; the module keeps one engine mask, so the engine's plan is reused."""
    from attnkit.masks import causal, resolve

    a = attnkit.build("dilated", window=3)
    pat = a.pattern_mask(16, 16, causal=True)
    assert a._engine_mask(pat, resolve(causal=True)) is a._engine_mask(pat, resolve(causal=True)) is pat
    b = attnkit.build("block-sparse")
    user = from_function(lambda b_, h, q, kv: q >= kv, name="f")
    first = b._engine_mask(None, resolve(user, causal=True))
    assert first is b._engine_mask(None, resolve(user, causal=True))
    assert first is not b._engine_mask(None, resolve(from_function(lambda b_, h, q, kv: q >= kv), causal=True))
    assert dense(first, 6).equal(dense(user & causal(), 6))
