"""``informer`` causal form (float64): exactness with u >= L, lazy rows = cumulative mean, the online top-u.

The conformance kit (tests/test_conformance.py) holds the causal torch path to
the plain reference, outputs and gradients, and runs the causality check.
"""

from __future__ import annotations

import torch
from attnkit_lowrank.informer.module import causal_sample_indices, counts, online_top
from attnkit_lowrank.informer.naive import reference

import attnkit
from attnkit.masks import causal as causal_mask

F64 = torch.float64


def _qkv(B=2, H=2, L=40, D=8, E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=F64), torch.randn(B, H, L, D, generator=g, dtype=F64),
            torch.randn(B, H, L, E, generator=g, dtype=F64))


def test_causal_with_every_query_active_is_causal_softmax():
    q, k, v = _qkv(L=20)
    attn = attnkit.build("informer", factor=50).double()          # u >= L
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attn(q, k, v, causal=True), ref, atol=1e-12, rtol=1e-10)


def test_causal_lazy_rows_take_the_cumulative_mean_and_active_rows_attend_to_the_past():
    q, k, v = _qkv(L=60)
    attn = attnkit.build("informer", factor=1, chunk_size=7).double()
    out = attn(q, k, v, causal=True)
    _, u = counts(1, 60, 60)
    active = online_top(attn.causal_sparsity(q, k), u, 7)
    assert active[..., :u].all()                                    # the first u are always active
    assert (~active).any() and active.sum() > 4 * u                 # some lazy; more than u active overall
    cum = v.cumsum(2) / torch.arange(1, 61, dtype=F64)[:, None]
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[~active], cum[~active], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out[active], dense[active], atol=1e-12, rtol=1e-10)


def test_online_top_equals_brute_force_and_ignores_later_values():
    g = torch.Generator().manual_seed(3)
    m = torch.randint(0, 6, (2, 3, 50), generator=g).to(F64)    # many ties
    for u in (1, 3, 8):
        brute = torch.tensor([[[int(sum(1 for j in range(i) if m[b, h, j] >= m[b, h, i]) < u)
                                for i in range(50)] for h in range(3)] for b in range(2)], dtype=torch.bool)
        for chunk in (1, 6, 64):
            assert torch.equal(online_top(m, u, chunk), brute)
    m2 = m.clone()
    m2[..., 30:] = 100.0
    assert torch.equal(online_top(m2, 3, 6)[..., :30], online_top(m, 3, 6)[..., :30])


def test_causal_samples_come_from_the_prefix_and_do_not_depend_on_the_length():
    idx = causal_sample_indices(0, 300, 9, torch.device("cpu"))
    assert (idx <= torch.arange(300)[:, None]).all() and (idx >= 0).all()
    assert idx[:, 0].max() > 100                                    # not all from the start
    assert torch.equal(causal_sample_indices(0, 40, 9, torch.device("cpu")), idx[:40])


def test_causal_module_matches_reference_with_gradients():
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=1, H=2, L=30))
    attn = attnkit.build("informer", factor=1, chunk_size=5).double()
    out = attn(q, k, v, causal=True)
    ref = reference(attn, q, k, v, mask=causal_mask())
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(out)
    g1 = torch.autograd.grad((out * w).sum(), (q, k, v))
    g2 = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_causal_cross_is_refused():
    q, k, v = _qkv(L=10)
    attn = attnkit.build("informer")
    try:
        attn(q[:, :, :5], k, v, causal=True)
    except attnkit.UnsupportedFeatureError as e:
        assert "causal" in str(e)
    else:
        raise AssertionError("causal with L != S was accepted")
