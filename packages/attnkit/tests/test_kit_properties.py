"""Property tests (hypothesis): random shapes and random mask compositions.

* softmax (both backends) equals masked dense softmax, where the dense mask
  is built here independently of :mod:`attnkit.masks`;
* :class:`attnkit.BlockIndex` agrees with that dense mask for random block
  sizes: FULL tiles are all True, SKIP tiles all False.

Shapes are small and include 1s; ``max_examples`` is kept small (the suite
stays fast) and ``deadline=None`` (timing on a busy 2-core machine varies).
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks as M
from attnkit.reference import masked_softmax_attention

SETTINGS = settings(max_examples=25, deadline=None, database=None,  # no .hypothesis/ example database
                    suppress_health_check=[HealthCheck.too_slow])

# mask functions: (name, fn(b, h, q_pos, kv_pos) -> bool); positions, so the same code builds the dense mask
FUNCTIONS = {
    "stride3": lambda b, h, q, kv: (q - kv) % 3 != 1,
    "head-parity": lambda b, h, q, kv: (q + h) % 2 == kv % 2,
    "even-keys": lambda b, h, q, kv: kv % 2 == 0,
    "batch-first-half": lambda b, h, q, kv: kv * 2 <= q + b,
}
#: functions of absolute positions (not of q - kv): drawn only for L == S, see
#: test_default_positions_when_lengths_differ (the core's default positions for L != S disagree with its docs)
ABSOLUTE = {"even-keys", "batch-first-half"}


@st.composite
def leaf(draw, B, H, L, S):
    """One mask leaf: (mask object, dense bool (B, H, L, S) built here)."""
    qpos = torch.arange(L)[None, None, :, None] + (S - L)  # bottom-right aligned positions
    kpos = torch.arange(S)[None, None, None, :]
    kind = draw(st.sampled_from(["causal", "padding", "window", "document", "function", "tensor"]))
    if kind == "causal":
        return M.causal(), (kpos <= qpos).expand(B, H, L, S)
    if kind == "padding":
        kpm = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=S, max_size=S), min_size=B, max_size=B)))
        return M.key_padding(kpm), kpm[:, None, None, :].expand(B, H, L, S)
    if kind == "window":
        before, after = draw(st.integers(0, 4)), draw(st.integers(0, 4))
        d = qpos - kpos
        return M.sliding_window(before, after), ((d <= before) & (d >= -after)).expand(B, H, L, S)
    if kind == "document":
        q_ids = torch.tensor(draw(st.lists(st.lists(st.integers(0, 2), min_size=L, max_size=L), min_size=B,
                                           max_size=B)))
        kv_ids = torch.tensor(draw(st.lists(st.lists(st.integers(0, 2), min_size=S, max_size=S), min_size=B,
                                            max_size=B)))
        dense = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
        return M.document(q_ids, kv_ids), dense.expand(B, H, L, S)
    if kind == "function":
        name = draw(st.sampled_from(sorted(FUNCTIONS) if L == S else sorted(set(FUNCTIONS) - ABSOLUTE)))
        fn = FUNCTIONS[name]
        b = torch.arange(B)[:, None, None, None]
        h = torch.arange(H)[None, :, None, None]
        dense = fn(b, h, qpos, kpos).expand(B, H, L, S)
        return M.from_function(fn, name=name, batch_dependent="batch" in name, head_dependent="head" in name), dense
    shape = (draw(st.sampled_from([1, B])), draw(st.sampled_from([1, H])), L, S)
    bits = draw(st.lists(st.booleans(), min_size=math.prod(shape), max_size=math.prod(shape)))
    t = torch.tensor(bits).view(shape)
    return M.from_tensor(t), t.expand(B, H, L, S)


@st.composite
def composition(draw):
    """Random sizes and a random &/| tree of up to three leaves, with its dense mask."""
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    L, S = draw(st.integers(1, 11)), draw(st.integers(1, 11))
    D, E = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    mask, dense = draw(leaf(B, H, L, S))
    for _ in range(draw(st.integers(0, 2))):
        other, od = draw(leaf(B, H, L, S))
        if draw(st.booleans()):
            mask, dense = mask & other, dense & od
        else:
            mask, dense = mask | other, dense | od
    return (B, H, L, S, D, E), mask, dense


@SETTINGS
@given(composition(), st.integers(0, 2**16))
def test_softmax_equals_the_masked_dense_reference(setup, seed):
    (B, H, L, S, D, E), mask, dense = setup
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, E, generator=g, dtype=torch.float64)
    want = masked_softmax_attention(q, k, v, keep=dense)
    for backend in ("sdpa", "torch"):
        got = attnkit.build("softmax", backend=backend)(q, k, v, mask=mask)
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7,
                                   msg=lambda m, backend=backend: f"{backend}, {mask!r}: {m}")


@SETTINGS
@given(composition(), st.integers(1, 6), st.integers(1, 6))
def test_block_index_agrees_with_the_dense_mask(setup, bq, bk):
    (B, H, L, S, _, _), mask, dense = setup
    index = mask.block_index(B, H, L, S, block_size=(bq, bk))
    nq, nk = math.ceil(L / bq), math.ceil(S / bk)
    assert index.state.shape[-2:] == (nq, nk)
    state = index.state.expand(B, H, nq, nk)
    padded = torch.nn.functional.pad(dense, (0, nk * bk - S, 0, nq * bq - L), value=False)
    valid = torch.nn.functional.pad(torch.ones(L, S, dtype=torch.bool), (0, nk * bk - S, 0, nq * bq - L))
    tiles = padded.view(B, H, nq, bq, nk, bk)
    valid = valid.view(1, 1, nq, bq, nk, bk)
    all_true = (tiles | ~valid).all(dim=(3, 5))
    any_true = tiles.any(dim=(3, 5))
    full_wrong = (state == M.FULL) & ~all_true
    skip_wrong = (state == M.SKIP) & any_true
    assert not bool(full_wrong.any()), f"{mask!r}: FULL tiles with a False pair at {full_wrong.nonzero().tolist()}"
    assert not bool(skip_wrong.any()), f"{mask!r}: SKIP tiles with a True pair at {skip_wrong.nonzero().tolist()}"


def test_default_positions_when_lengths_differ():
    geom = M.Geometry(1, 1, 2, 5, torch.device("cpu"))
    q_pos, k_pos = geom.pos()
    assert k_pos.tolist() == [[0, 1, 2, 3, 4]] and q_pos.tolist() == [[3, 4]]
