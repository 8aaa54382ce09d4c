"""The torch path (chunked forms and modules) against slow per-position loops, outputs and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from comparisons import DTYPES, grads
from comparisons import close as _close

import attnkit
from attnkit_kernelized import chunked, reference
from attnkit_kernelized.feature_maps import (
    dpfp_feature_map,
    draw_gaussian_features,
    elu_feature_map,
    favor_positive,
)


def _inputs(B, H, L, M, E, dtype, seed=0, positive=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, H, L, M, generator=g, dtype=torch.float64)
    k = torch.rand(B, H, L, M, generator=g, dtype=torch.float64)
    if not positive:
        q, k = q - 0.5, k - 0.5
    v = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _grads(outs, inputs, seed=1):
    return grads(outs, inputs, seed, allow_unused=True)


# ------------------------------------------------------------------ chunked forms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,chunk", [(1, 4), (7, 3), (37, 8), (16, 16), (20, 64)])
def test_causal_linear_matches_loop(dtype, L, chunk):
    q, k, v = _inputs(2, 3, L, 5, 4, dtype)
    num, den, _ = chunked.causal_linear(q, k, v, chunk=chunk)
    rnum, rden = reference.linear_reference(q, k, v, causal=True)
    _close(num, rnum, dtype)
    _close(den, rden, dtype)
    for a, b in zip(_grads([num, den], [q, k, v]), _grads([rnum, rden], [q, k, v])):
        _close(a, b, dtype, 10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_linear_state_carries_over(dtype):
    """Running two halves with the state of the first equals one run (what step() relies on)."""
    q, k, v = _inputs(1, 2, 23, 4, 3, dtype)
    num, den, final = chunked.causal_linear(q, k, v, chunk=4)
    n1, d1, st = chunked.causal_linear(q[:, :, :10], k[:, :, :10], v[:, :, :10], chunk=4)
    n2, d2, st2 = chunked.causal_linear(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], chunk=5, state=st)
    _close(torch.cat([n1, n2], 2), num, dtype)
    _close(torch.cat([d1, d2], 2), den, dtype)
    _close(st2[0], final[0], dtype)
    _close(final[0], k.transpose(-1, -2) @ v, dtype)      # S_L = sum_j phi_k_j v_j^T
    _close(final[1], k.sum(2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_noncausal_linear_matches_loop_cross(dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.rand(2, 2, 5, 4, generator=g, dtype=torch.float64).to(dtype)
    k = torch.rand(2, 2, 9, 4, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, 2, 9, 3, generator=g, dtype=torch.float64).to(dtype)
    num, den = chunked.noncausal_linear(q, k, v)
    rnum, rden = reference.linear_reference(q, k, v, causal=False)
    _close(num, rnum, dtype)
    _close(den, rden, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,chunk", [(1, 4), (13, 4), (32, 8)])
def test_gated_matches_loop(dtype, L, chunk):
    q, k, v = _inputs(2, 2, L, 4, 3, dtype)
    g = torch.rand(2, 2, L, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g = (0.05 + 0.9 * g).to(dtype).requires_grad_()
    num, den, _ = chunked.causal_gated(q, k * (1 - g).unsqueeze(-1), v, torch.log(g), chunk=chunk)
    rnum, rden = reference.gated_reference(q, k, v, g)
    _close(num, rnum, dtype)
    _close(den, rden, dtype)
    for a, b in zip(_grads([num, den], [q, k, v, g]), _grads([rnum, rden], [q, k, v, g])):
        _close(a, b, dtype, 10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,chunk", [(1, 4), (13, 4), (30, 8)])
def test_delta_matches_loop(dtype, L, chunk):
    q, k, v = _inputs(2, 2, L, 6, 3, dtype)
    kn = (k / k.sum(-1, keepdim=True)).detach().requires_grad_()
    beta = torch.rand(2, 2, L, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    beta = beta.to(dtype).requires_grad_()
    out, _ = chunked.causal_delta(q, kn, v, beta, chunk=chunk)
    ref = reference.delta_reference(q, kn, v, beta)
    _close(out, ref, dtype)
    for a, b in zip(_grads([out], [q, kn, v, beta]), _grads([ref], [q, kn, v, beta])):
        _close(a, b, dtype, 10)


def test_delta_rule_replaces_instead_of_adding():
    """Writing a new value under the same key with beta = 1 overwrites it (the 'remove' of the delta
    rule); the additive (linear) memory would return the sum."""
    key = torch.tensor([1.0, 0.0, 0.0])
    other = torch.tensor([0.0, 1.0, 0.0])
    k = torch.stack([key, other, key])[None, None]                 # (1, 1, 3, 3)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 7.0]])[None, None]
    q = torch.stack([key, key, key])[None, None]
    beta = torch.ones(1, 1, 3)
    out, _ = chunked.causal_delta(q, k, v, beta, chunk=2)
    torch.testing.assert_close(out[0, 0, 2], torch.tensor([5.0, 7.0]))   # latest value, not [6, 7]
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([1.0, 0.0]))
    lin, _, _ = chunked.causal_linear(q, k, v, chunk=2)
    torch.testing.assert_close(lin[0, 0, 2], torch.tensor([6.0, 7.0]))


# ------------------------------------------------------------------ modules
def _build(name, dtype, **opts):
    torch.manual_seed(0)
    base = {"num_heads": 2, "head_dim": 4, "backend": "torch"}
    return attnkit.build(name, **{**base, **opts}).to(dtype).eval()


def _qkv(L, S, dtype, seed=11, E=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, L, 4, generator=g, dtype=torch.float64) * 0.7
    k = torch.randn(2, 2, S, 4, generator=g, dtype=torch.float64) * 0.7
    v = torch.randn(2, 2, S, E, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def _kpm(S):
    kpm = torch.ones(2, S, dtype=torch.bool)
    kpm[0, -2:] = False
    kpm[1, 1] = False
    return kpm


def _module_reference(attn, q, k, v, causal, kpm):
    """The module's features through the per-position loops."""
    phi_q, phi_k = attn.feature_pair(q, k, causal=causal, key_padding_mask=kpm)
    m = torch.ones(q.shape[0], k.shape[2], dtype=q.dtype) if kpm is None else kpm.to(q.dtype)
    m = m[:, None, :, None]
    name = attn.spec.name
    if name == "fast-weight":
        beta = attn.betas(k)
        return attn._scale_out(reference.delta_reference(phi_q, phi_k * m, v * m, beta))
    if name == "rfa" and causal and attn.gate:
        g = torch.sigmoid(attn.gate_logits(k))
        g = torch.where(m[..., 0] > 0, g, torch.ones_like(g))
        return reference.normalize(*reference.gated_reference(phi_q, phi_k * m, v * m, g))
    return reference.normalize(*reference.linear_reference(phi_q, phi_k * m, v * m, causal=causal))


CASES = [
    ("linear", {}), ("linear", {"feature_map": "relu"}), ("linear", {"feature_map": "dpfp", "dpfp_nu": 2}),
    ("performer", {"num_features": 16}), ("performer", {"num_features": 8, "feature_map": "trig"}),
    ("performer", {"num_features": 16, "feature_map": "generalized"}),
    ("rfa", {"num_features": 8}), ("rfa", {"num_features": 8, "feature_map": "positive", "gate": False}),
    ("fast-weight", {}), ("fast-weight", {"feature_map": "elu", "beta": 0.7, "normalize": False}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,opts", CASES)
def test_module_torch_path_matches_loops(name, opts, dtype):
    attn = _build(name, dtype, chunk_size=4, **opts)
    caps = attn.caps
    setups = [(True, 11, 11, None), (True, 11, 11, _kpm(11))]
    if caps.noncausal:
        setups += [(False, 11, 11, None), (False, 6, 9, _kpm(9))]
    for causal, L, S, kpm in setups:
        q, k, v = _qkv(L, S, dtype)
        out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
        ref = _module_reference(attn, q, k, v, causal, kpm)
        _close(out, ref, dtype, 10)
        for a, b in zip(_grads([out], [q, k, v]), _grads([ref], [q, k, v])):
            _close(a, b, dtype, 100)


@pytest.mark.parametrize("name,opts", CASES)
def test_streaming_uneven_chunks_equals_causal_forward(name, opts):
    dtype = torch.float64
    attn = _build(name, dtype, chunk_size=4, **opts)
    q, k, v = _qkv(17, 17, dtype, E=5)
    full = attn(q, k, v, causal=True)
    state = attn.init_state(2, dtype=dtype)
    outs, start = [], 0
    for size in (5, 1, 2, 9):
        o, state = attn.step(q[:, :, start:start + size], k[:, :, start:start + size],
                             v[:, :, start:start + size], state)
        outs.append(o)
        start += size
    _close(torch.cat(outs, 2), full, dtype, 10)


def test_padded_keys_add_nothing_and_empty_rows_are_zero():
    attn = _build("performer", torch.float64, num_features=16)
    q, k, v = _qkv(6, 6, torch.float64)
    kpm = torch.ones(2, 6, dtype=torch.bool)
    kpm[1] = False                     # batch 1: every key padded
    kpm[0, 0] = False                  # batch 0: causal query 0 sees nothing
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0
    assert out[0, :, 0].abs().max() == 0
    assert out[0, :, 1:].abs().min() > 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert k.grad[1].abs().max() == 0


# ------------------------------------------------------------------ feature maps and options
def test_feature_maps():
    x = torch.tensor([[1.0, -2.0, 0.5]])
    assert torch.all(elu_feature_map(torch.randn(100)) > 0)
    phi = dpfp_feature_map(x, nu=2)
    assert phi.shape == (1, 12)
    r = torch.tensor([[1.0, 0.0, 0.5, 0.0, 2.0, 0.0]])
    torch.testing.assert_close(phi[:, :6], r * torch.roll(r, 1, -1))
    torch.testing.assert_close(phi[:, 6:], r * torch.roll(r, 2, -1))


def test_orthogonal_features_are_orthogonal_in_blocks():
    w = draw_gaussian_features(12, 4, orthogonal=True, generator=torch.Generator().manual_seed(0),
                               dtype=torch.float64)
    for b in range(3):
        blk = w[4 * b:4 * (b + 1)]
        gram = blk @ blk.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() < 1e-10
    iid = draw_gaussian_features(12, 4, orthogonal=False, generator=torch.Generator().manual_seed(0),
                                 dtype=torch.float64)
    gram = iid[:4] @ iid[:4].T
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() > 1e-3


def test_favor_positive_is_positive_and_unbiased_at_zero():
    w = draw_gaussian_features(64, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = torch.zeros(8, dtype=torch.float64)
    phi = favor_positive(x, w)
    assert torch.all(phi > 0)
    torch.testing.assert_close((phi * phi).sum(), torch.tensor(1.0, dtype=torch.float64))   # exp(0 . 0) = 1


def test_performer_redraw_api():
    a = attnkit.build("performer", num_heads=2, head_dim=4, num_features=8, seed=3)
    b = attnkit.build("performer", num_heads=2, head_dim=4, num_features=8, seed=3)
    torch.testing.assert_close(a.features, b.features)          # reproducible from the seed
    first = a.features.clone()
    a.redraw_features()
    assert not torch.allclose(a.features, first)
    b.redraw_features()
    torch.testing.assert_close(a.features, b.features)          # the n-th draw is reproducible too
    a.redraw_features(seed=123)
    c = attnkit.build("performer", num_heads=2, head_dim=4, num_features=8, seed=123)
    torch.testing.assert_close(a.features, c.features)
    assert "features" in a.state_dict()


def test_performer_redraws_every_n_training_calls_only():
    attn = attnkit.build("performer", num_heads=1, head_dim=4, num_features=8, redraw_interval=2, seed=0)
    q = torch.randn(1, 1, 5, 4)
    seen = []
    attn.train()
    for _ in range(5):
        attn(q, q, q)
        seen.append(attn.features.clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, True, False, True]
    attn.eval()
    before = attn.features.clone()
    for _ in range(3):
        attn(q, q, q)
    assert torch.equal(attn.features, before)


def test_rfa_gate_matters_and_is_learned():
    gated = _build("rfa", torch.float64, num_features=8)
    plain = _build("rfa", torch.float64, num_features=8, gate=False)
    q, k, v = _qkv(9, 9, torch.float64)
    a, b = gated(q, k, v, causal=True), plain(q, k, v, causal=True)
    assert (a - b).abs().max() > 1e-3
    # non-causal RFA is ungated, so both agree
    torch.testing.assert_close(gated(q, k, v), plain(q, k, v))
    a.sum().backward()
    assert gated.gate_weight.grad.abs().sum() > 0 and gated.log_sigma.grad.abs().sum() > 0


def test_linear_scale_option_changes_elu_map():
    q, k, v = _qkv(7, 7, torch.float64)
    plain = _build("linear", torch.float64)
    scaled = _build("linear", torch.float64, scale=0.25)
    phi_q, _ = scaled.feature_pair(q, k, causal=False)
    torch.testing.assert_close(phi_q, F.elu(q * 0.5) + 1)
    assert (plain(q, k, v) - scaled(q, k, v)).abs().max() > 1e-4
