"""``poolingformer`` beyond the kit (float64): the two levels' limits, longer sequences, bad options."""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank.poolingformer.module import pool, segments
from attnkit_lowrank.poolingformer.naive import reference

import attnkit
from attnkit.masks import causal as causal_mask
from attnkit.masks import key_padding

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


def _padding(L):
    """Row 0: 7 padded at the end; row 1: 5 in the middle and 2 at the start."""
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[0, L - 7:] = False
    kpm[1, 10:15] = False
    kpm[1, :2] = False
    return kpm


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_matches_reference_and_removing_the_padded_tokens(causal):
    L = 37
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=2, L=L))
    kpm = _padding(L)
    attn = attnkit.build("poolingformer", window=6, pool_window=14, pool_size=3, pool_stride=2,
                         chunk_size=8).double()
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    ref = reference(attn, q, k, v, mask=key_padding(kpm) & causal_mask() if causal else key_padding(kpm))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v), retain_graph=True)
    for a, b in zip(got, torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    pad = ~kpm[:, None, :, None]
    assert got[1].masked_select(pad).abs().max() == 0 and got[2].masked_select(pad).abs().max() == 0
    # a real query's output is that of the sequence with the padded tokens removed
    for b in range(2):
        idx = kpm[b].nonzero().flatten()
        cut = attn(q[b:b + 1, :, idx], k[b:b + 1, :, idx], v[b:b + 1, :, idx], causal=causal)
        torch.testing.assert_close(out[b:b + 1, :, idx], cut, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -1e30])
def test_padded_keys_have_no_influence_whatever_they_hold(fill):
    L = 30
    q, k, v = _qkv(B=2, L=L)
    kpm = _padding(L)
    attn = attnkit.build("poolingformer", window=4, pool_window=12, pool_size=4, pool_stride=3,
                         chunk_size=7).double()
    base = attn(q, k, v, key_padding_mask=kpm)
    pad = ~kpm[:, None, :, None]
    out = attn(q, k.masked_fill(pad, fill), v.masked_fill(pad, fill), key_padding_mask=kpm)
    assert torch.equal(out, base) and torch.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
def test_fully_padded_row_gives_zeros_and_finite_gradients(causal):
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=2, L=12))
    kpm = torch.ones(2, 12, dtype=torch.bool)
    kpm[1] = False
    attn = attnkit.build("poolingformer", window=4, pool_window=8, pool_size=3, pool_stride=2).double()
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().min() > 0
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads) and grads[2][1].abs().max() == 0


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


def test_a_key_padding_mask_batched_by_vmap_is_refused_by_name_and_a_shared_one_works():
    """Each sequence's windows are those of it without its padded keys: a per-sample mask under torch.func.vmap
    is a per-sample shape, refused with attnkit's error (PyTorch's was 'aten::nonzero' inside vmap); the same
    mask for every sample works and equals the calls one by one."""
    from torch.func import vmap

    from attnkit.errors import UnsupportedFeatureError

    attn = attnkit.build("poolingformer", num_heads=2, head_dim=4).double()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(3))
    kpm = torch.ones(3, 12, dtype=torch.bool)
    kpm[1, 8:] = False
    with pytest.raises(UnsupportedFeatureError, match=r"key_padding_mask batched by torch.func.vmap.*Pass one"):
        vmap(lambda a, b, d, m: attn(a[None], b[None], d[None], key_padding_mask=m[None]))(q, k, v, kpm)
    shared = kpm[1:2]
    got = vmap(lambda a, b, d: attn(a[None], b[None], d[None], key_padding_mask=shared)[0])(q, k, v)
    want = torch.cat([attn(q[i:i + 1], k[i:i + 1], v[i:i + 1], key_padding_mask=shared) for i in range(3)])
    torch.testing.assert_close(got, want)
