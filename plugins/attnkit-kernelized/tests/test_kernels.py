"""The product primitive of the numba and triton kernels against dense formulas: every mode (causal,
reverse, full), with a carried state, the fused denominator and normalisation, odd lengths, chunk sizes."""

from __future__ import annotations

import pytest
import torch
from comparisons import backends

from attnkit_kernelized._ops import backend_module

PRODUCTS = {"numba": "numba_linear_product", "triton": "triton_linear_product"}


def _product(backend):
    return getattr(backend_module("linear", backend), PRODUCTS[backend])


def _dense(x, y, w, S0, z0, mode):
    A = x @ y.transpose(-1, -2)
    if mode == "causal":
        A = A.tril()
    elif mode == "reverse":
        A = A.triu()
    return A @ w + x @ S0, A.sum(-1) + (x * z0[:, None]).sum(-1), S0 + y.transpose(-1, -2) @ w, z0 + y.sum(1)


@pytest.mark.parametrize("backend", backends("numba", "triton"))
@pytest.mark.parametrize("mode,L,S", [("causal", 1, 1), ("causal", 33, 33), ("reverse", 19, 19), ("reverse", 65, 65),
                                      ("full", 7, 12), ("full", 40, 3)])
@pytest.mark.parametrize("chunk", [1, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_product_matches_dense_formulas(backend, mode, L, S, chunk, dtype):
    g = torch.Generator().manual_seed(L + S)
    x, y = torch.rand(3, L, 5, generator=g, dtype=torch.float64), torch.rand(3, S, 5, generator=g, dtype=torch.float64)
    w = torch.randn(3, S, 6, generator=g, dtype=torch.float64)
    S0, z0 = torch.rand(3, 5, 6, generator=g, dtype=torch.float64), torch.rand(3, 5, generator=g, dtype=torch.float64)
    want = _dense(x, y, w, S0, z0, mode)
    out, den, Sf, zf = _product(backend)(*(t.to(dtype) for t in (x, y, w, S0, z0)), mode, chunk, True, False)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    for a, b in zip((out, den, Sf, zf), want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, **tol)
    normed, den2, _, _ = _product(backend)(*(t.to(dtype) for t in (x, y, w, S0, z0)), mode, chunk, True, True)
    torch.testing.assert_close(normed.double(), want[0] / want[1].unsqueeze(-1), **tol)
    plain, no_den, _, z_same = _product(backend)(*(t.to(dtype) for t in (x, y, w, S0, z0)), mode, chunk, False, False)
    torch.testing.assert_close(plain.double(), want[0], **tol)
    assert no_den.shape == (3, 0) and torch.equal(z_same, z0.to(dtype))      # z accumulates only with den


@pytest.mark.parametrize("backend", backends("numba", "triton"))
def test_normalised_rows_without_keys_are_zero_and_nan_stays(backend):
    x = torch.rand(1, 4, 3, dtype=torch.float64)
    x[0, 2] = float("nan")
    y = torch.zeros(1, 4, 3, dtype=torch.float64)
    y[0, 3] = 1.0
    w = torch.randn(1, 4, 2, dtype=torch.float64)
    out, den, _, _ = _product(backend)(x, y, w, torch.zeros(1, 3, 2, dtype=torch.float64),
                                       torch.zeros(1, 3, dtype=torch.float64), "causal", 2, True, True)
    assert (out[0, :2] == 0).all() and torch.isnan(out[0, 2]).all() and torch.isfinite(out[0, 3]).all()


@pytest.mark.parametrize("backend", backends("numba", "triton"))
def test_product_rejects_bad_arguments(backend):
    x = torch.zeros(2, 4, 3, dtype=torch.float64)
    z, S = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, 3, dtype=torch.float64)
    prod = _product(backend)
    with pytest.raises(ValueError, match="mode"):
        prod(x, x, x, S, z, "sideways", 4, True, False)
    with pytest.raises(ValueError, match="L == S"):
        prod(x, x[:, :3], x[:, :3], S, z, "causal", 4, True, False)
    with pytest.raises(ValueError, match="normalize"):
        prod(x, x, x, S, z, "causal", 4, False, True)
    if backend == "numba":
        with pytest.raises(ValueError, match="share dtype"):
            prod(x, x, x.float(), S, z, "causal", 4, True, False)
        with pytest.raises(ValueError, match=r"\(N, S, DW\)"):
            prod(x, x, x[:1], S, z, "causal", 4, True, False)


@pytest.mark.parametrize("backend", backends("numba", "triton"))
@pytest.mark.parametrize("mode", ["causal", "reverse", "full"])
def test_product_with_256_features_matches_dense_formulas(backend, mode):
    """256 features (a performer's default): the feature dimension runs in several blocks (triton) or one wide
    tile (numba); the result must not depend on it."""
    g = torch.Generator().manual_seed(5)
    L = 45
    x, y = torch.rand(2, L, 256, generator=g, dtype=torch.float64), torch.rand(2, L, 256, generator=g,
                                                                               dtype=torch.float64)
    w = torch.randn(2, L, 8, generator=g, dtype=torch.float64)
    S0, z0 = torch.rand(2, 256, 8, generator=g, dtype=torch.float64), torch.rand(2, 256, generator=g,
                                                                                 dtype=torch.float64)
    want = _dense(x, y, w, S0, z0, mode)
    got = _product(backend)(x, y, w, S0, z0, mode, 64, True, False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
