"""The numba ``elu(x) + 1`` pass (linear/numba_elu.py) against torch's ``F.elu(x) + 1``, and its use by the module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit_kernelized.linear.numba_elu import elu_plus_one


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 3e-7)])
def test_values_and_gradient_match_torch(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 4099, generator=g, dtype=dtype) * 6).requires_grad_()   # not a multiple of a block
    with torch.no_grad():
        x[0, 0, :4] = torch.tensor([0.0, -0.0, 100.0, -200.0], dtype=dtype)
    got = elu_plus_one(x)
    x64 = x.detach().double()
    exact = torch.where(x64 > 0, x64 + 1, torch.exp(x64))   # elu(x) + 1 without expm1(x) + 1's cancellation
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=torch.finfo(dtype).tiny)   # float32 underflows
    torch.testing.assert_close(got, F.elu(x) + 1, rtol=tol, atol=tol)   # torch's own form: off by an ulp of 1
    gy = torch.randn_like(got)
    (a,) = torch.autograd.grad((got * gy).sum(), x)
    b = gy.double() * torch.where(x64 > 0, torch.ones_like(x64), torch.exp(x64.clamp(max=0)))   # d(elu + 1)/dx
    torch.testing.assert_close(a.double(), b, rtol=2 * tol, atol=torch.finfo(dtype).tiny)   # g * phi rounds again


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_special_values(dtype):
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -1e4, 3e38, -0.0], dtype=dtype)
    # whole vectors (8 float32 / 4 float64 at a time) hold the first copy and most of the second; its last
    # element (-0.0) is the one left after them
    x = torch.cat([special, torch.linspace(-3, 3, 13, dtype=dtype), special])
    assert x.numel() % 8 == 1 and x.numel() % 4 == 1
    y = elu_plus_one(x)
    for off in (0, 19):
        s = y[off:off + 6]
        assert torch.isnan(s[0]) and torch.isposinf(s[1]) and s[2] == 0 and s[3] == 0 and s[4] == x[4] + 1
        assert s[5] == 1
    assert elu_plus_one(torch.empty(0, 7)).shape == (0, 7)


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        elu_plus_one(torch.ones(3, dtype=torch.float16))


@pytest.mark.parametrize("scale", [None, 0.3])
def test_the_unfused_numba_path_uses_it_and_equals_the_torch_backend(monkeypatch, scale):
    """The module's unfused numba path (the map, then linear attention: what runs with the one-operator training
    form switched off, the baseline of the benchmarks) computes its features here."""
    from attnkit_kernelized.linear import numba_elu
    from attnkit_kernelized.linear.module import LinearAttention

    monkeypatch.setattr(LinearAttention, "_trained_causal", lambda *args: None)
    calls = []
    real = numba_elu.elu_plus_one
    monkeypatch.setattr(numba_elu, "elu_plus_one", lambda x: calls.append(x.shape) or real(x))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kpm = torch.ones(2, 37, dtype=torch.bool)
    kpm[1, -6:] = False
    fast = attnkit.build("linear", backend="numba", scale=scale)
    slow = attnkit.build("linear", backend="torch", scale=scale)
    a = fast(q, k, v, causal=True, key_padding_mask=kpm)
    b = slow(q, k, v, causal=True, key_padding_mask=kpm)
    assert len(calls) == 2                       # queries and keys of the one segment
    torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    gy = torch.randn_like(a)
    for x, y in zip(torch.autograd.grad((a * gy).sum(), (q, k, v)), torch.autograd.grad((b * gy).sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_row_kernel_on_strided_rows_and_a_short_scratch(dtype):
    """``elu1_row`` on a strided row runs the loops in pieces of its scratch (3 elements here): the same values as on
    the contiguous row, nothing written past ``dst``'s end."""
    import numba
    import numpy as np

    from attnkit_kernelized._vexp import constants, elu1_row

    @numba.njit
    def run(dst, src, scale, nbuf, cst, is32):
        elu1_row(dst, src, scale, nbuf, cst, is32)

    npdt = torch.empty(0, dtype=dtype).numpy().dtype
    x = np.random.default_rng(0).standard_normal(2 * 37).astype(npdt) * 4
    cst, is32 = constants(npdt), npdt == np.float32
    want = np.full(37 + 5, -7, dtype=npdt)
    run(want[:37], np.ascontiguousarray(x[::2]), npdt.type(0.5), np.empty(8, dtype=np.int32), cst, is32)
    got = np.full(37 + 5, -7, dtype=npdt)
    run(got[:37], x[::2], npdt.type(0.5), np.empty(3, dtype=np.int32), cst, is32)
    np.testing.assert_array_equal(got, want)
    assert (got[37:] == -7).all()
