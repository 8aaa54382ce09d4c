"""torch.export with a dynamic length: banded patterns (local, dilated, block-local, and global and longformer with
their global tokens apart) attend within their band (engine/dynamic.py) instead of a block plan, so one program
serves every length; the others fix the length."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit_sparse.engine import attend
from attnkit_sparse.engine.dynamic import attend_band, attend_dynamic, band_of, cover_of
from attnkit_sparse.patterns._atoms import BlockBand, PeriodicBand, PositionSet
from attnkit_sparse.patterns.global_ import longformer_mask

BANDED = [("local", {"window": 5}), ("dilated", {"window": 4, "dilation": 2}), ("block-local", {"block_size": 4}),
          ("global", {"window": 5, "num_global": 3}), ("longformer", {"window": 6, "dilation": 2, "num_global": 2})]


def _export(module, args, dims):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, dynamic_shapes=dims).module()


class _Call(torch.nn.Module):
    def __init__(self, attn, causal):
        super().__init__()
        self.attn, self.causal = attn, causal

    def forward(self, q, k, v, kpm):
        return self.attn(q, k, v, causal=self.causal, key_padding_mask=kpm)


def _args(n, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
    kpm = torch.ones(2, n, dtype=torch.bool)
    kpm[1, n - max(1, n // 3):] = False
    kpm[1, 0] = True
    return q, k, v, kpm


@pytest.mark.parametrize("name,opts", BANDED, ids=[b[0] for b in BANDED])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_banded_patterns_export_one_program_for_every_length(name, opts, causal, backend):
    assert backend in attnkit.get_spec(name).capabilities.export_dynamic
    torch.manual_seed(0)
    module = _Call(attnkit.build(name, num_heads=2, head_dim=8, backend=backend, **opts).eval(), causal)
    L = torch.export.Dim("L", min=1, max=2048)
    program = _export(module, _args(24, 0), ({2: L}, {2: L}, {2: L}, {1: L}))
    for n in (2, 15, 16, 17, 100, 129):
        a = _args(n, n)
        torch.testing.assert_close(program(*a), module(*a), rtol=1e-5, atol=1e-6)


def test_attend_band_equals_the_engine_with_a_wide_band_and_masked_rows():
    """A window wider than a chunk (several key chunks per query chunk), key padding that masks whole rows."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 300, 4, generator=g, dtype=torch.float64) for _ in range(3))
    kpm = torch.rand(1, 300, generator=g) > 0.5
    kpm[:, :40] = False                                       # the first causal rows see no key at all
    m = masks.causal() & masks.sliding_window(200, 0) & masks.key_padding(kpm)
    band = band_of(m)
    assert band == (0, 200)
    want = attend(q, k, v, m, scale=0.5, backend="torch")
    got = attend_band(q, k, v, m, band, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.all(got[:, :, :40] == 0)


@pytest.mark.parametrize("before,after,extra", [(0, 3, None), (40, 0, (10, 40)), (300, 0, (200, 300)),
                                                (0, 70, (-70, -30))])
def test_attend_band_with_bands_on_either_side(before, after, extra):
    """Bands wholly in the past or in the future (no key at distance 0) and a band ahead of the queries: the key
    windows line up with the query chunks whatever side of the query they lie on."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, 333, 4, generator=g, dtype=torch.float64) for _ in range(3))
    m = masks.sliding_window(before, after)
    if extra is not None:
        lo, hi = extra
        m = m & masks.from_function(lambda b, h, qi, ki: (qi - ki >= lo) & (qi - ki <= hi), name="ring")
    band = band_of(m) if extra is None else (max(-after, extra[0]), min(before, extra[1]))
    torch.testing.assert_close(attend_band(q, k, v, m, band, 0.5), attend(q, k, v, m, scale=0.5, backend="torch"),
                               rtol=1e-12, atol=1e-12)


def test_band_of_follows_the_reach_of_the_parts():
    assert band_of(masks.causal()) is None                           # unbounded to the past
    assert band_of(masks.causal() & masks.sliding_window(7, 0)) == (0, 7)
    assert band_of(masks.sliding_window(3, 2) | masks.sliding_window(1, 5)) == (-5, 3)
    assert band_of(masks.sliding_window(3, 2) | masks.causal()) is None
    assert band_of(PeriodicBand((1, 3), 2, 1)) == (-3, 6)            # per-head periods: the widest
    assert band_of(BlockBand(4, -1, 0)) == (-3, 7)                    # the block and the one before
    assert band_of(None) is None


@pytest.mark.parametrize("name", ["bigbird", "random", "strided"])
def test_patterns_without_a_band_fix_the_length(name):
    assert attnkit.get_spec(name).capabilities.export_dynamic == ()
    module = _Call(attnkit.build(name, num_heads=2, head_dim=8).eval(), False)
    L = torch.export.Dim("L", min=1, max=2048)
    with pytest.raises(Exception, match="Constraints violated"):
        _export(module, _args(24, 0), ({2: L}, {2: L}, {2: L}, {1: L}))


def test_a_function_mask_input_over_several_blocks_exports():
    """A mask function reading an input of the program, over more than one block (session 47's kit case had
    one): the function is evaluated at the gathered pairs with index tensors of more than four dimensions,
    and its result was checked against a four-dimensional shape (an InvalidInputError)."""
    attn = attnkit.build("local", num_heads=2, head_dim=8, window=40).eval()

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, q, k, v, visible):
            m = masks.from_function(lambda b, h, qp, kp: visible[b, kp], name="visible", batch_dependent=True)
            return self.attn(q, k, v, causal=True, mask=m)

    g = torch.Generator().manual_seed(0)
    xs = tuple(torch.randn(2, 2, 200, 8, generator=g) for _ in range(3))
    visible = torch.rand(2, 200, generator=g) > 0.3
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(Call(), (*xs, visible)).module()
        other = torch.rand(2, 200, generator=g) > 0.5
        for vis in (visible, other):
            torch.testing.assert_close(program(*xs, vis), Call()(*xs, vis), rtol=1e-5, atol=1e-6)


def _index_equals_torch(index, q, k, v, m, block, g):
    """The engine's numba kernels over ``index`` against the torch backend on ``m``: outputs and the gradients of
    q, k and v in float64."""
    from attnkit_sparse.engine import numba_ops

    got = numba_ops.attend_index(q, k, v, index, (block, block), 0.5)
    want = attend(q, k, v, m, scale=0.5, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    gout = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), gout), torch.autograd.grad(want, (q, k, v), gout)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-backward", "two-kernel-backward"])
@pytest.mark.parametrize("before,after,block", [(100, 0, 32), (40, 7, 16), (3, 3, 64), (0, 70, 16), (300, 0, 64)])
def test_band_index_runs_the_engine_kernels_like_a_plan(monkeypatch, fused, before, after, block):
    """The block index a dynamic program builds from tensors (engine/dynamic.py, band_index) drives the numba
    kernels to the torch backend's result, forward and backward, in float64: bands in the past, around the
    query and ahead of it, key padding that empties whole rows (per-batch tiles), lengths that are not
    multiples of the block."""
    from attnkit_sparse.engine import numba_ops
    from attnkit_sparse.engine.dynamic import band_index

    monkeypatch.setattr(numba_ops, "FUSED_BACKWARD", fused)
    g = torch.Generator().manual_seed(before + after + block)
    L = 301
    kpm = torch.rand(3, L, generator=g) > 0.4
    kpm[:, :30] = False
    m = masks.sliding_window(before, after) & masks.key_padding(kpm)
    q, k, v = (torch.randn(3, 2, L, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    index = band_index(q, m, band_of(m), block)
    assert index[0].shape == (3, 1, -(-L // block))          # one row per batch element (the padding differs)
    _index_equals_torch(index, q, k, v, m, block, g)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-backward", "two-kernel-backward"])
@pytest.mark.parametrize("block_size,previous,block", [(16, False, 16), (16, True, 16), (24, True, 16)])
def test_band_index_leaves_out_tiles_with_no_allowed_pair(monkeypatch, fused, block_size, previous, block):
    """Block-local masks hold tiles inside their band where no pair is allowed (a key block past the query's
    block): the index lists only the tiles with an allowed pair (fewer than the band's key blocks inside the
    sequence, the count of each row exactly its used tiles, the key-major lists the same tiles), and the kernels
    still give the torch backend's result, forward and backward, in float64."""
    from attnkit_sparse.engine import numba_ops
    from attnkit_sparse.engine.dynamic import _keep, band_index
    from attnkit_sparse.patterns.local import block_local_mask

    monkeypatch.setattr(numba_ops, "FUSED_BACKWARD", fused)
    g = torch.Generator().manual_seed(block_size + previous + block)
    L = 123
    m = block_local_mask(block_size, causal=True, previous=previous)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    index = band_index(q, m, band_of(m), block)
    kv_count, kv_idx, kv_tile, q_count = index[:4]
    keep, N, first, _, _, K = _keep(q, m, band_of(m), block)
    used = keep.view(*keep.shape[:3], block, K, block).any(-1).any(3)        # (1, 1, N, K)
    j = torch.arange(N).view(N, 1) + first + torch.arange(K)                  # each row's key blocks in the band
    in_sequence = int(((j >= 0) & (j < N)).sum())
    assert (kv_count == used.sum(-1)).all() and int(kv_count.sum()) < in_sequence
    assert int(kv_count.sum()) == int(q_count.sum())                          # the same tiles, key-major
    listed = torch.arange(K) < kv_count.unsqueeze(-1)
    assert (kv_tile[listed] != -2).all() and (kv_tile[~listed] == -2).all()
    _index_equals_torch(index, q, k, v, m, block, g)


def test_a_numba_dynamic_program_holds_the_engine_operator():
    """The numba backend's dynamic program runs the engine's kernel (not the torch band path), and the torch
    backend's does not."""
    args = _args(40, 1)
    L = torch.export.Dim("L", min=1, max=2048)
    for backend, holds in (("numba", True), ("torch", False)):
        module = _Call(attnkit.build("local", num_heads=2, head_dim=8, window=20, backend=backend).eval(), True)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(module, args, dynamic_shapes=({2: L}, {2: L}, {2: L}, {1: L}))
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert any("numba_block_attention" in o for o in ops) is holds, sorted(ops)
        torch.testing.assert_close(ep.module()(*_args(77, 2)), module(*_args(77, 2)), rtol=1e-5, atol=1e-6)


def test_cover_holds_a_band_with_global_positions():
    keys, queries = PositionSet((0, 9), "key"), PositionSet((4,), "query")
    band = masks.sliding_window(3, 2)
    assert cover_of(band | keys | queries) == (-2, 3, (0, 9), (4,))
    # & intersects the bands and keeps every part's global positions (a pair in them may lie outside the band)
    assert cover_of((band | keys) & masks.causal()) == (0, 3, (0, 9), ())
    assert cover_of(keys & masks.causal()) == (1, 0, (0, 9), ())              # no band, the global keys only
    assert cover_of(masks.causal() | keys) is None                           # unbounded to the past
    assert cover_of(longformer_mask(8, (0, 5), causal=True)) == (0, 8, (0, 5), (0, 5))
    assert cover_of(masks.causal()) is None and cover_of(None) is None


@pytest.mark.parametrize("block", [None, 16], ids=["torch-band", "numba-kernels"])
@pytest.mark.parametrize("causal", [False, True])
def test_attend_dynamic_with_global_positions_equals_the_engine(block, causal):
    """Band, global keys and global queries apart, merged by their log-sum-exps, against the plan's torch backend
    in float64, forward and backward: global positions inside and past the sequence, a global key inside the
    band (counted once), key padding that leaves some rows with no key at all."""
    g = torch.Generator().manual_seed(7 + causal)
    L = 70
    kpm = torch.rand(2, L, generator=g) > 0.3
    kpm[1, :12] = False
    m = longformer_mask(10, (0, 3, 40, 90), causal=causal) & masks.key_padding(kpm)
    cover = cover_of(m)
    assert cover == ((0, 10) if causal else (-5, 5)) + ((0, 3, 40, 90), (0, 3, 40, 90))
    q, k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    got = attend_dynamic(q, k, v, m, cover, 0.5, block)
    want = attend(q, k, v, m, scale=0.5, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    gout = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(got, (q, k, v), gout)
    for a, b in zip(grads, torch.autograd.grad(want, (q, k, v), gout)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_explicit_global_positions_are_a_limit_the_program_asserts():
    """Explicit global positions need keys reaching past the last one: a limit of the instance in eager, an
    assertion of the dynamic program (exported with the length from 1: no constraint violated)."""
    attn = attnkit.build("global", num_heads=2, head_dim=8, window=5, global_positions=[0, 7, 30]).eval()
    module = _Call(attn, False)
    L = torch.export.Dim("L", min=1, max=2048)
    program = _export(module, _args(40, 0), ({2: L}, {2: L}, {2: L}, {1: L}))
    for n in (31, 64, 100):
        torch.testing.assert_close(program(*_args(n, n)), module(*_args(n, n)), rtol=1e-5, atol=1e-6)
    with pytest.raises(attnkit.UnsupportedFeatureError, match="the global position 30 needs at least 31 keys"):
        module(*_args(30, 1))
    with pytest.raises(Exception, match=r">= 31"):     # (the program keeps the expression, not the message)
        program(*_args(30, 1))
