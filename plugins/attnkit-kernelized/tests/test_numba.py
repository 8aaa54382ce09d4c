"""numba CPU kernels against the torch path: outputs and gradients, float32 and float64, odd lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from comparisons import DTYPES
from comparisons import close as _close
from comparisons import grads as _grads
from comparisons import rand as _rand

import attnkit
from attnkit_kernelized import chunked
from attnkit_kernelized.kernels import causal_numba
from attnkit_kernelized.kernels.numba_autograd import causal_delta_numba, causal_gated_numba, causal_linear_numba


@pytest.mark.parametrize("np_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("L,chunk", [(1, 1), (5, 2), (33, 8), (64, 32), (65, 32)])
def test_causal_product_kernel_matches_numpy(np_dtype, L, chunk):
    rng = np.random.default_rng(L)
    x = rng.random((3, L, 5)).astype(np_dtype)
    y = rng.random((3, L, 5)).astype(np_dtype)
    w = rng.standard_normal((3, L, 4)).astype(np_dtype)
    A = np.einsum("ntm,njm->ntj", x, y)
    tol = 1e-4 if np_dtype == np.float32 else 1e-12
    for reverse, tri in ((False, np.tril), (True, np.triu)):
        out, den = causal_numba.causal_product(x, y, w, reverse=reverse, chunk=chunk, with_den=True)
        np.testing.assert_allclose(out, np.einsum("ntj,nje->nte", tri(A), w), rtol=tol, atol=tol)
        np.testing.assert_allclose(den, tri(A).sum(-1), rtol=tol, atol=tol)
        assert out.dtype == np_dtype


def test_causal_product_kernel_rejects_bad_arguments():
    x = np.zeros((2, 4, 3), np.float32)
    with pytest.raises(ValueError, match="share dtype"):
        causal_numba.causal_product(x, x, np.zeros((2, 4, 3), np.float64))
    with pytest.raises(ValueError, match=r"\(N, L, E\)"):
        causal_numba.causal_product(x, x, np.zeros((2, 5, 3), np.float32))
    with pytest.raises(ValueError, match="chunk"):
        causal_numba.causal_product(x, x, x, chunk=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,chunk", [(1, 4), (7, 3), (50, 16), (64, 32)])
def test_causal_linear_numba_matches_torch(dtype, L, chunk):
    q = _rand((2, 3, L, 6), 0, dtype, positive=True)
    k = _rand((2, 3, L, 6), 1, dtype, positive=True)
    v = _rand((2, 3, L, 5), 2, dtype)
    num, den, _ = chunked.causal_linear(q, k, v, chunk=8)
    n2, d2 = causal_linear_numba(q, k, v, chunk=chunk)
    _close(n2, num, dtype)
    _close(d2, den, dtype)
    for a, b in zip(_grads([n2, d2], [q, k, v]), _grads([num, den], [q, k, v])):
        _close(a, b, dtype, 10)
    # only the numerator used: the denominator's gradient is None in backward
    num, _, _ = chunked.causal_linear(q, k, v, chunk=8)
    n2, _ = causal_linear_numba(q, k, v, chunk=chunk)
    for a, b in zip(_grads([n2], [q, k, v]), _grads([num], [q, k, v])):
        _close(a, b, dtype, 10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,chunk", [(1, 4), (9, 4), (37, 16)])
def test_causal_delta_numba_matches_torch(dtype, L, chunk):
    q = _rand((2, 2, L, 6), 0, dtype, positive=True)
    k0 = torch.rand(2, 2, L, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    k = (k0 / k0.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    v = _rand((2, 2, L, 3), 2, dtype)
    beta = torch.rand(2, 2, L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    beta = beta.to(dtype).requires_grad_()
    out, _ = chunked.causal_delta(q, k, v, beta, chunk=5)
    o2 = causal_delta_numba(q, k, v, beta, chunk=chunk)
    _close(o2, out, dtype)
    for a, b in zip(_grads([o2], [q, k, v, beta]), _grads([out], [q, k, v, beta])):
        _close(a, b, dtype, 10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,chunk", [(1, 4), (9, 4), (37, 16)])
def test_causal_gated_numba_matches_torch(dtype, L, chunk):
    q = _rand((2, 2, L, 6), 0, dtype, positive=True)
    k = _rand((2, 2, L, 6), 1, dtype, positive=True)
    v = _rand((2, 2, L, 3), 2, dtype)
    g = torch.rand(2, 2, L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    g = (0.05 + 0.95 * g).to(dtype).requires_grad_()
    num, den, _ = chunked.causal_gated(q, k, v, torch.log(g), chunk=5)
    n2, d2 = causal_gated_numba(q, k, v, g, chunk=chunk)
    _close(n2, num, dtype)
    _close(d2, den, dtype)
    for a, b in zip(_grads([n2, d2], [q, k, v, g]), _grads([num, den], [q, k, v, g])):
        _close(a, b, dtype, 10)


def test_numba_gradcheck_float64():
    q = _rand((1, 2, 7, 3), 0, torch.float64, positive=True)
    k = _rand((1, 2, 7, 3), 1, torch.float64, positive=True)
    v = _rand((1, 2, 7, 2), 2, torch.float64)
    b = torch.rand(1, 2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, v: causal_linear_numba(q, k, v, chunk=3), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v, b: causal_delta_numba(q, k, v, b, chunk=3), (q, k, v, b))
    assert torch.autograd.gradcheck(lambda q, k, v, b: causal_gated_numba(q, k, v, b, chunk=3), (q, k, v, b))


@pytest.mark.parametrize("name,opts", [("linear", {}), ("performer", {"num_features": 12}),
                                       ("fast-weight", {}), ("rfa", {"num_features": 8})])
def test_auto_dispatch_picks_numba_for_cpu(name, opts):
    attn = attnkit.build(name, num_heads=2, head_dim=4, **opts)
    q = torch.randn(1, 2, 5, 4)
    assert attn.resolve_backend(q, q, q) == "numba"
    assert attnkit.get_spec(name).capabilities.backends[-1] == "torch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,opts", [("linear", {}), ("performer", {"num_features": 12}),
                                       ("performer", {"num_features": 6, "feature_map": "trig"}),
                                       ("fast-weight", {}), ("fast-weight", {"beta": 0.5, "feature_map": "relu"}),
                                       ("rfa", {"num_features": 8}),
                                       ("rfa", {"num_features": 8, "feature_map": "positive", "gate": False})])
def test_module_numba_backend_matches_torch_backend(name, opts, dtype):
    torch.manual_seed(0)
    ref = attnkit.build(name, num_heads=2, head_dim=4, backend="torch", chunk_size=8, **opts).to(dtype)
    fast = attnkit.build(name, num_heads=2, head_dim=4, backend="numba", chunk_size=8, **opts).to(dtype)
    fast.load_state_dict(ref.state_dict())
    kpm = torch.ones(2, 41, dtype=torch.bool)
    kpm[1, 3] = False
    kpm[0, 0] = False
    for key_padding_mask in (None, kpm):
        q, k, v = (_rand((2, 2, 41, 4), s, dtype) for s in (5, 6, 7))
        want = ref(q, k, v, causal=True, key_padding_mask=key_padding_mask)
        got = fast(q, k, v, causal=True, key_padding_mask=key_padding_mask)
        _close(got, want, dtype)
        for a, b in zip(_grads([got], [q, k, v]), _grads([want], [q, k, v])):
            _close(a, b, dtype, 10)


def test_causal_product_state_in_and_out():
    rng = np.random.default_rng(0)
    x, y = rng.random((2, 30, 5)), rng.random((2, 30, 5))
    w = rng.standard_normal((2, 30, 3))
    out, den, state = causal_numba.causal_product(x, y, w, chunk=4, with_den=True, return_state=True)
    o1, d1, st = causal_numba.causal_product(x[:, :11], y[:, :11], w[:, :11], chunk=4, with_den=True,
                                             return_state=True)
    o2, d2, st2 = causal_numba.causal_product(x[:, 11:], y[:, 11:], w[:, 11:], chunk=8, with_den=True,
                                              state=st, return_state=True)
    np.testing.assert_allclose(np.concatenate([o1, o2], 1), out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([d1, d2], 1), den, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st2[0], np.einsum("nle,nlm->nem", w, y), rtol=1e-12)   # S^T = sum_j w_j y_j^T
    np.testing.assert_allclose(st2[1], y.sum(1), rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,opts", [("linear", {}), ("performer", {"num_features": 12})])
def test_no_grad_segmented_forward_matches_torch(name, opts, dtype):
    """Without autograd the numba path runs segment by segment, carrying the state across segments."""
    torch.manual_seed(0)
    ref = attnkit.build(name, num_heads=2, head_dim=4, backend="torch", **opts).to(dtype)
    fast = attnkit.build(name, num_heads=2, head_dim=4, **opts).to(dtype)
    fast.load_state_dict(ref.state_dict())
    fast.inference_segment = 7
    q, k, v = (_rand((2, 2, 40, 4), s, dtype).detach() for s in (5, 6, 7))
    kpm = torch.ones(2, 40, dtype=torch.bool)
    kpm[0, :9] = False          # the first segment and a bit of the second see nothing
    kpm[1, 20] = False
    with torch.no_grad():
        for key_padding_mask in (None, kpm):
            want = ref(q, k, v, causal=True, key_padding_mask=key_padding_mask)
            got = fast(q, k, v, causal=True, key_padding_mask=key_padding_mask)
            _close(got, want, dtype)
    assert (got[0, :, :9] == 0).all()
