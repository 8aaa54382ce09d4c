"""The performer's fused numba feature kernels (performer/numba_features.py) against their torch expressions.

Values and gradients in float64 (float32 within its rounding), with padded keys holding NaN/Inf, the
per-feature maximum and per-sequence minimum of the key exponents, the vectorised exp on its own, and the
module using them (numba backend) against the torch backend.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit_kernelized._vexp import constants, exp_row
from attnkit_kernelized.common import padded
from attnkit_kernelized.performer.numba_features import positive_features


def _reference(q, k, w, scale, pad):
    """The torch form: queries shifted by their (detached) largest projection, keys exp(W'k - scale|k|^2/2)."""
    pq = q @ w.T
    phi_q = torch.exp(pq - pq.detach().amax(-1, keepdim=True))
    lk = k @ w.T - 0.5 * scale * (k * k).sum(-1, keepdim=True)
    phi_k = torch.exp(lk)
    hi_src, lo_src = lk.detach(), lk.detach()
    if pad is not None:
        phi_k = phi_k.masked_fill(pad, 0.0)
        hi_src, lo_src = hi_src.masked_fill(pad, float("-inf")), lo_src.masked_fill(pad, float("inf"))
    return phi_q, phi_k, hi_src.amax(dim=2), lo_src.amin(dim=(2, 3))


def _inputs(dtype, L=37, pad_tail=5, poison=True):
    g = torch.Generator().manual_seed(0)
    B, H, D, M = 2, 3, 8, 24
    q = torch.randn(B, H, L, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, L, D, generator=g, dtype=dtype)
    w = torch.randn(M, D, generator=g, dtype=dtype) * 0.6
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, L - pad_tail:] = False
    if poison:   # padded keys hold anything: they must not reach a value or a gradient
        k[1, :, L - 2] = float("nan")
        k[1, :, L - 1] = float("inf")
    return q.requires_grad_(), k.requires_grad_(), w, kpm


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_values_and_gradients_match_the_torch_expressions(dtype):
    q, k, w, kpm = _inputs(dtype)
    pad = padded(kpm)
    scale = 0.36
    got = positive_features(q, k, w, scale, pad)[:4]
    # the reference cannot take the poisoned keys (NaN * 0 is NaN): it gets them zeroed, which changes no real key
    k_ref = k.detach().masked_fill(pad, 0.0).requires_grad_()
    ref = _reference(q, k_ref, w, scale, pad)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-6, rtol=2e-6)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, **tol)
    assert torch.isfinite(got[1]).all() and (got[1][1, :, -5:] == 0).all()
    gq, gk = torch.randn_like(got[0]), torch.randn_like(got[1])
    dq, dk = torch.autograd.grad((got[0] * gq).sum() + (got[1] * gk).sum(), (q, k))
    rq, rk = torch.autograd.grad((ref[0] * gq).sum() + (ref[1] * gk).sum(), (q, k_ref))
    gtol = dict(atol=1e-11, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dq, rq, **gtol)
    torch.testing.assert_close(dk, rk, **gtol)
    assert torch.isfinite(dk).all() and (dk[1, :, -5:] == 0).all()


def test_a_fully_padded_sequence_has_no_exponent_range_and_zero_features():
    q, k, w, kpm = _inputs(torch.float64, poison=False)
    kpm[0] = False
    phi_q, phi_k, hi, lo, growth = positive_features(q, k, w, 1.0, padded(kpm))
    assert (phi_k[0] == 0).all() and torch.isneginf(hi[0]).all() and torch.isposinf(lo[0]).all()
    assert torch.isfinite(hi[1]).all() and torch.isfinite(lo[1]).all()
    assert ((phi_q > 0) & (phi_q <= 1)).all() and torch.allclose(phi_q.amax(-1), torch.ones(()).double())
    assert (growth[0] == 0).all()


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("pad_first", [False, True])
def test_growth_is_the_log_space_forms(chunk, pad_first):
    """The key operator's growth (the largest growth of a feature's running key maximum inside a chunk, which a
    program's torch.cond reads) equals what the log-space form computes from its chunks' references
    (performer/chunk.py: ``_references``), from no earlier key: at a length no chunk divides, with padded keys
    (holding NaN/Inf), keys of large norm and, with ``pad_first``, a chunk whose first keys are padded (then a
    feature's first key inside it is unbounded growth)."""
    from attnkit_kernelized.performer.chunk import NO_KEY, _chunks, _references

    q, k, w, kpm = _inputs(torch.float64, L=77)
    k = (k.detach() * torch.linspace(0.5, 4.0, 77, dtype=torch.float64)[:, None]).requires_grad_()   # maxima grow
    if pad_first:
        kpm[0, :chunk + 2] = False
    pad = padded(kpm)
    growth = positive_features(q, k, w, 0.36, pad, chunk)[4]
    lk = k.detach().masked_fill(pad, 0.0) @ w.T - 0.18 * (k.detach().masked_fill(pad, 0.0) ** 2).sum(-1, keepdim=True)
    lk_c = _chunks(lk.masked_fill(pad, NO_KEY), chunk, -(-77 // chunk), NO_KEY)
    end, _, first = _references(lk_c, lk.new_full((2, 3, w.shape[0]), NO_KEY))
    want = (end - first).amax(dim=(-3, -2, -1))                                   # (B, H)
    want = torch.where(want > 1e29, torch.full_like(want, float("inf")), want)     # NO_KEY against a real key
    torch.testing.assert_close(growth, want, atol=1e-10, rtol=1e-12)
    if chunk > 1:   # (one key a chunk: no growth)
        assert (growth[1] > 0).all() and (not pad_first or torch.isposinf(growth[0]).all())


def test_refuses_what_it_cannot_run():
    q, k, w, _ = _inputs(torch.float64, poison=False)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        positive_features(q.half(), k.half(), w, 1.0, None)


@pytest.mark.parametrize("dtype,lo,hi,rtol", [(np.float32, -80.0, 60.0, 3e-7), (np.float64, -700.0, 600.0, 1e-14)])
def test_vectorised_exp_against_numpy(dtype, lo, hi, rtol):
    import numba

    @numba.njit
    def run(x, c):
        exp_row(x, c)

    x = np.linspace(lo, hi, 20001).astype(dtype)
    got = x.copy()
    run(got, dtype(1.5))
    want = np.exp((x - dtype(1.5)).astype(np.float64))      # the argument rounded as the kernel rounds it
    np.testing.assert_allclose(got, want, rtol=rtol, atol=0)   # reassociated, float32 reached 4.1e-7
    special = np.array([-1e4, -np.inf, np.nan, 0.0, np.inf, 1e4, 700.0 if dtype == np.float32 else 1e3], dtype=dtype)
    for n in (1, 2, 3):   # the specials in whole vectors (8 float32 / 4 float64) and in the rest after them
        got = np.tile(special, n)
        run(got, dtype(0.0))
        for s in got.reshape(n, -1):
            assert s[0] == 0 and s[1] == 0 and np.isnan(s[2]) and s[3] == 1
            assert np.isposinf(s[4]) and np.isposinf(s[5]) and np.isposinf(s[6])   # above the highest argument


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vectorised_exp_equals_its_loops_bit_for_bit(dtype):
    """``exp_row`` runs whole vectors through IR (``_exp_at``) and the rest through numba loops (``_exp_loops``):
    both are the same arithmetic, so a value does not depend on where in a row it falls."""
    import numba

    from attnkit_kernelized._vexp import _exp_loops

    @numba.njit
    def both(x, c, cst, is32):
        a, b = x.copy(), x.copy()
        nbuf = np.empty(x.shape[0], dtype=np.int32)
        exp_row(a, c)
        _exp_loops(b, c, nbuf, cst, is32)
        return a, b

    x = np.concatenate([np.linspace(-800, 800, 4001), [np.nan, np.inf, -np.inf, 88.7, 88.71, 709.7, 709.71]])
    a, b = both(x.astype(dtype), dtype(0.25), constants(np.dtype(dtype)), dtype == np.float32)
    assert np.array_equal(a.view(f"i{a.itemsize}"), b.view(f"i{b.itemsize}"))


@pytest.mark.parametrize("with_padding", [False, True])
def test_the_module_on_numba_equals_the_torch_backend(with_padding):
    torch.manual_seed(0)
    kw = dict(num_heads=2, head_dim=8, num_features=16, seed=3)
    fast = attnkit.build("performer", backend="numba", **kw).double()
    slow = attnkit.build("performer", backend="torch", **kw).double()
    q, k, v = (torch.randn(2, 2, 29, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = None
    if with_padding:
        kpm = torch.ones(2, 29, dtype=torch.bool)
        kpm[0, -4:] = False
    a = fast(q, k, v, causal=True, key_padding_mask=kpm)
    b = slow(q, k, v, causal=True, key_padding_mask=kpm)
    torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    g = torch.randn_like(a)
    ga = torch.autograd.grad((a * g).sum(), (q, k, v))
    gb = torch.autograd.grad((b * g).sum(), (q, k, v))
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-8)
