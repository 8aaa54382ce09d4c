"""torch.export with a dynamic length: banded patterns (local, dilated, block-local) attend within their band
(engine/dynamic.py) instead of a block plan, so one program serves every length; the others fix the length."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit_sparse.engine import attend
from attnkit_sparse.engine.dynamic import attend_band, band_of
from attnkit_sparse.patterns._atoms import BlockBand, PeriodicBand

BANDED = [("local", {"window": 5}), ("dilated", {"window": 4, "dilation": 2}), ("block-local", {"block_size": 4})]


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


@pytest.mark.parametrize("name", ["bigbird", "longformer", "strided"])
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
