"""``fast-weight``'s fused causal forward (fast_weight/numba_fused.py: the feature map and the chunked delta rule in
one kernel, no autograd) against the torch form on torch's features, and the module's fused path against its
autograd path and the torch backend, in float64 (float32 within rounding).

Padded keys hold NaN/Inf and must not reach a value; lengths are not multiples of the block; a state is carried in
and out; every feature map the module offers.
"""

from __future__ import annotations

import pytest
import torch
from comparisons import fast_weight_features

import attnkit
from attnkit_kernelized.common import padded
from attnkit_kernelized.fast_weight import chunk
from attnkit_kernelized.fast_weight.numba_fused import fused_causal
from attnkit_kernelized.fast_weight.numba_ops import BLOCK
from attnkit_kernelized.feature_maps import deterministic_feature_map, sum_normalized

MAPS = [("dpfp", 1, True), ("dpfp", 2, True), ("dpfp", 3, False), ("elu", 1, True), ("elu", 1, False),
        ("relu", 1, True), ("softplus", 1, True)]


def _inputs(dtype, L, D=5, E=7, pad_tail=5, with_state=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, H = 2, 3
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    beta = torch.rand(B, H, L, generator=g, dtype=dtype)
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, L - min(pad_tail, L):] = False
    return q, k, v, beta, kpm, g, with_state


def _torch_fused(q, k, v, beta, pad, S0, name, nu, normalize):
    """torch's features (the module's map, sum-normalised when asked; padded keys 0), then the torch form."""
    fq, fk = fast_weight_features(q, k, pad, name, nu, normalize)
    return chunk.delta_rule(fq, fk, v, beta, S0, chunk=4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L", [1, BLOCK - 3, 2 * BLOCK + 5])
@pytest.mark.parametrize("name,nu,normalize", MAPS, ids=str)
def test_the_fused_kernel_equals_the_torch_form(dtype, L, name, nu, normalize):
    q, k, v, beta, kpm, g, _ = _inputs(dtype, L)
    if not normalize:     # beta |k|^2 below 2: the update stays a contraction (float32 rounding not amplified)
        q, k, beta = q * 0.3, k * 0.3, beta * 0.1
    pad = padded(kpm)
    M = 2 * q.shape[-1] * nu if name == "dpfp" else q.shape[-1]
    S0 = torch.rand(2, 3, M, v.shape[-1], generator=g, dtype=dtype) * 0.1
    # padded keys hold anything (the core zeroes v there): they must not reach a value
    k_bad = k.clone()
    k_bad[1, :, L - 1] = float("nan")
    if L > 1:
        k_bad[1, :, L - 2] = float("inf")
    v = v.masked_fill(pad, 0.0)
    got = fused_causal(q, k_bad, v, beta, pad, S0, feature_map=name, nu=nu, normalize=normalize)
    want = _torch_fused(q, k.masked_fill(pad, 0.0), v, beta, pad, S0, name, nu, normalize)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    for what, a, b in zip(("out", "S"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, what=what: f"{what}: {m}")
    assert torch.isfinite(got[0]).all()


def test_a_nan_query_stays_in_its_row():
    q, k, v, beta, _, _, _ = _inputs(torch.float64, 2 * BLOCK + 3)
    q[0, 1, 7, 2] = float("nan")
    out, _ = fused_causal(q, k, v, beta, None, None)
    bad = ~torch.isfinite(out)
    assert bad[0, 1, 7].all() and bad.sum() == out.shape[-1]


def test_refuses_what_it_cannot_run():
    q, k, v, beta, _, _, _ = _inputs(torch.float64, 8)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        fused_causal(q.half(), k.half(), v.half(), beta.half(), None, None)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        fused_causal(q, k, v, beta[..., :-1], None, None)
    with pytest.raises(ValueError, match="feature_map"):
        fused_causal(q, k, v, beta, None, None, feature_map="favor")


@pytest.mark.parametrize("opts", [{}, {"feature_map": "elu", "scale": 0.5}, {"beta": 0.4, "dpfp_nu": 2}], ids=str)
@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("L", [29, 2048 + 37])
def test_the_module_without_autograd_equals_its_autograd_path_and_the_torch_backend(opts, with_padding, L):
    kw = dict(num_heads=2, head_dim=8, **opts)
    fast = attnkit.build("fast-weight", backend="numba", **kw).double()
    slow = attnkit.build("fast-weight", backend="torch", **kw).double()
    slow.load_state_dict(fast.state_dict())
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, 8, dtype=torch.float64) for _ in range(3))
    kpm = None
    if with_padding:
        kpm = torch.ones(2, L, dtype=torch.bool)
        kpm[0, -4:] = False
        kpm[1, :9] = False
        k[0, :, -1] = float("nan")
        v[0, :, -2] = float("inf")
    with torch.no_grad():
        a, sa = fast(q, k, v, causal=True, key_padding_mask=kpm, return_state=True)
        c, sc = slow(q, k, v, causal=True, key_padding_mask=kpm, return_state=True)
    qg = q.clone().requires_grad_()
    b, sb = fast(qg, k, v, causal=True, key_padding_mask=kpm, return_state=True)   # the training operator
    assert torch.isfinite(a).all()
    for x in (b, c):
        torch.testing.assert_close(a, x.detach(), atol=1e-11, rtol=1e-9)
    torch.testing.assert_close(sa.data["S"], sb.data["S"].detach(), atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(sa.data["S"], sc.data["S"], atol=1e-10, rtol=1e-9)


def test_the_module_takes_the_fused_path_only_without_autograd(monkeypatch):
    from attnkit_kernelized.fast_weight import numba_fused

    calls = []
    real = numba_fused.fused_causal
    monkeypatch.setattr(numba_fused, "fused_causal", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attn = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="numba")
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    with torch.no_grad():
        attn(q, k, v, causal=True)
    assert calls == [1]
    out = attn(q, k, v, causal=True)          # the learned beta needs its gradient: the unfused path
    out.sum().backward()
    assert attn.beta_weight.grad is not None and calls == [1]
    attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="torch")(q, k, v, causal=True)
    fixed = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="numba", beta=0.5)
    fixed(q, k, v.requires_grad_(), causal=True).sum().backward()    # an input needs a gradient
    assert calls == [1]
    fixed(q, k, v.detach(), causal=True)      # no parameter, no input with a gradient: fused
    assert calls == [1, 1]


def test_streaming_without_autograd_continues_a_state():
    fast = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="numba").double()
    slow = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="torch").double()
    slow.load_state_dict(fast.state_dict())
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 50, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        full = slow(q, k, v, causal=True)
        a, st = fast(q[:, :, :23], k[:, :, :23], v[:, :, :23], causal=True, return_state=True)
        b, _ = fast(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], causal=True, state=st, return_state=True)
    torch.testing.assert_close(torch.cat([a, b], dim=2), full, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("name,nu,normalize", MAPS, ids=str)
def test_the_numba_feature_map_and_its_gradient_equal_torch(name, nu, normalize):
    """:func:`.numba_features.phi` (the numba backend's features under autograd) against torch's map and
    normalisation in float64, values and gradients; zeros (a DPFP row of zeros sums to 0) and ties at 0."""
    from attnkit_kernelized.fast_weight.numba_features import phi

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 11, 5, generator=g, dtype=torch.float64)
    x[0, 0, 0] = 0.0                        # a row whose features are all 0 (DPFP, relu): its sum is 0
    x[1, 2, 3, 1] = 0.0
    x.requires_grad_()
    want_map = deterministic_feature_map(name, nu=nu)
    want = want_map(x)
    if normalize:
        want = sum_normalized(want)
    got = phi(x, name, nu, normalize)
    torch.testing.assert_close(got, want, atol=1e-14, rtol=1e-12)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    (gw,) = torch.autograd.grad((want * w).sum(), x)
    (gg,) = torch.autograd.grad((got * w).sum(), x)
    torch.testing.assert_close(gg, gw, atol=1e-13, rtol=1e-11)
    assert torch.autograd.gradcheck(lambda t: phi(t, name, nu, normalize), (x[:1, :1, 1:4].detach().requires_grad_(),))


def test_the_module_s_three_numba_paths_agree_to_the_bit(monkeypatch):
    """The fused no-grad kernel, the training operator (fast_weight/numba_train.py) and the unfused path (the
    numba features, then the delta rule: what runs with the training operator switched off) compute the same
    arithmetic in the same order; the unfused path computes its features with the numba map."""
    from attnkit_kernelized.fast_weight import numba_features
    from attnkit_kernelized.fast_weight.module import FastWeightAttention

    attn = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="numba")
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    with torch.no_grad():
        fused = attn(q, k, v, causal=True)
    trained = attn(q, k, v.requires_grad_(), causal=True)
    calls = []
    real = numba_features.phi
    monkeypatch.setattr(numba_features, "phi", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(FastWeightAttention, "_trained_causal", lambda *args: None)
    unfused = attn(q, k, v, causal=True)
    assert len(calls) == 2                     # queries and keys
    torch.testing.assert_close(trained.detach(), fused, atol=0, rtol=0)
    torch.testing.assert_close(unfused.detach(), fused, atol=0, rtol=0)


def test_dpfp_with_more_rolls_than_d_runs_torch_s_map_on_the_numba_backend():
    """The kernels wrap a roll once (nu <= D): beyond, the numba backend keeps torch's features and the unfused
    path, and the kernels refuse it by name."""
    from attnkit_kernelized.fast_weight.numba_features import phi

    fast = attnkit.build("fast-weight", num_heads=1, head_dim=2, dpfp_nu=3, backend="numba").double()
    slow = attnkit.build("fast-weight", num_heads=1, head_dim=2, dpfp_nu=3, backend="torch").double()
    slow.load_state_dict(fast.state_dict())
    q, k, v = (torch.randn(1, 1, 9, 2, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(fast(q, k, v, causal=True), slow(q, k, v, causal=True), atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="nu must lie in"):
        phi(q, "dpfp", 3)
    with pytest.raises(ValueError, match="nu must lie in"):
        fused_causal(q, k, v, torch.rand(1, 1, 9, dtype=torch.float64), None, None, nu=3)
