"""``poolingformer`` beyond the kit (float64): the two levels' limits, longer sequences, bad options."""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank.poolingformer.module import pool, segments
from attnkit_lowrank.poolingformer.naive import reference

import attnkit
from attnkit.masks import causal as causal_mask

F64 = torch.float64


def _qkv(B=1, H=2, L=40, D=8, E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=F64), torch.randn(B, H, L, D, generator=g, dtype=F64),
            torch.randn(B, H, L, E, generator=g, dtype=F64))


@pytest.mark.parametrize("causal", [False, True])
def test_windows_covering_everything_and_unit_segments_give_twice_softmax(causal):
    q, k, v = _qkv(L=20)
    attn = attnkit.build("poolingformer", window=64, pool_window=64, pool_size=1, pool_stride=1).double()
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(attn(q, k, v, causal=causal), 2 * dense, atol=1e-12, rtol=1e-10)


def test_pool_matches_explicit_segment_means():
    x = torch.randn(1, 1, 23, 3, dtype=F64)
    for size, stride in ((5, 4), (4, 4), (3, 1), (30, 2)):
        start, end = segments(23, size, stride)
        want = torch.stack([x[0, 0, s:e].mean(0) for s, e in zip(start.tolist(), end.tolist())])
        assert int(end[-1]) == 23
        torch.testing.assert_close(pool(x, size, stride)[0, 0], want, atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_longer_sequence_with_chunks_matches_reference_with_gradients(causal):
    q, k, v = (t.requires_grad_(True) for t in _qkv(L=90))
    attn = attnkit.build("poolingformer", window=8, pool_window=30, pool_size=5, pool_stride=4,
                         chunk_size=16).double()
    out = attn(q, k, v, causal=causal)
    ref = reference(attn, q, k, v, mask=causal_mask() if causal else None)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v), retain_graph=True)
    for a, b in zip(got, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    # far keys have no influence: position 0 sees neither key 89 (window) nor its segment (pool window)
    gk, gv = torch.autograd.grad(out[:, :, 0].sum(), (k, v))
    assert gk[:, :, 60:].abs().max() == 0 and gv[:, :, 60:].abs().max() == 0 and gv[:, :, 0].abs().min() > 0


def test_bad_options_are_named():
    with pytest.raises(attnkit.InvalidInputError, match="pool_stride"):
        attnkit.build("poolingformer", pool_size=3, pool_stride=4)
    with pytest.raises(attnkit.InvalidInputError, match="pool_size"):
        attnkit.build("poolingformer", pool_size=9, pool_stride=4, pool_window=8)
    with pytest.raises(attnkit.InvalidInputError, match="window"):
        attnkit.build("poolingformer", window=0)
    q, k, v = _qkv(L=10)
    with pytest.raises(attnkit.UnsupportedFeatureError):
        attnkit.build("poolingformer").double()(q[:, :, :5], k, v)
