"""Published checks of FAVOR+ (Choromanski et al. 2021) and the error against exact softmax attention."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.reference import reference_attention
from attnkit_kernelized.feature_maps import draw_gaussian_features, favor_positive, favor_trig


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_paper_exact_case(backend, dtype):
    """q = k = ones, d = 1, v = [1, 0, 0], causal, 10,000 features -> [1, 1/2, 1/3] within 0.02."""
    torch.manual_seed(0)
    attn = attnkit.build("performer", num_heads=1, head_dim=1, num_features=10_000, backend=backend).to(dtype)
    q = k = torch.ones(1, 1, 3, 1, dtype=dtype)
    v = torch.tensor([1.0, 0.0, 0.0], dtype=dtype).view(1, 1, 3, 1)
    out = attn(q, k, v, causal=True).view(3)
    expected = torch.tensor([1.0, 1 / 2, 1 / 3], dtype=dtype)
    assert (out - expected).abs().max() < 0.02, out
    # the non-causal form averages all three values
    torch.testing.assert_close(attn(q, k, v).view(3), torch.full((3,), 1 / 3, dtype=dtype), atol=0.02, rtol=0)


def test_favor_plus_kernel_estimate_mse():
    """FAVOR+ estimate of exp(x . y), d = 32, 32,000 features, x, y ~ N(0, 0.15^2): MSE < 1e-3."""
    g = torch.Generator().manual_seed(0)
    d, m, n = 32, 32_000, 200
    w = draw_gaussian_features(m, d, orthogonal=True, generator=g, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.15
    y = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.15
    est = (favor_positive(x, w) * favor_positive(y, w)).sum(-1)
    exact = torch.exp((x * y).sum(-1))
    mse = ((est - exact) ** 2).mean().item()
    assert mse < 1e-3, mse
    # the estimate is unbiased but not exact: with 32 features the error is far larger
    w_small = draw_gaussian_features(32, d, orthogonal=True, generator=g, dtype=torch.float64)
    est_small = (favor_positive(x, w_small) * favor_positive(y, w_small)).sum(-1)
    assert ((est_small - exact) ** 2).mean().item() > 10 * mse
    # the v1 trigonometric map estimates the same kernel
    est_trig = (favor_trig(x, w) * favor_trig(y, w)).sum(-1)
    assert ((est_trig - exact) ** 2).mean().item() < 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_error_against_softmax_falls_with_features(causal):
    """Relative error of `performer` vs exact softmax attention, averaged over seeds, falls as M grows."""
    q, k, v = (torch.randn(2, 2, 64, 16, generator=torch.Generator().manual_seed(s), dtype=torch.float64) * 0.5
               for s in (1, 2, 3))
    ref = reference_attention(q, k, v, causal=causal)
    errors = []
    for m in (16, 128, 1024):
        errs = []
        for seed in range(4):
            attn = attnkit.build("performer", num_heads=2, head_dim=16, num_features=m, seed=seed).double()
            out = attn(q, k, v, causal=causal)
            errs.append(((out - ref).norm() / ref.norm()).item())
        errors.append(sum(errs) / len(errs))
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < errors[0] / 3, errors        # ~ 1/sqrt(M): 8x more features, ~2.8x less error
    assert errors[2] < 0.1, errors
