"""``linear``'s causal training operator (linear/numba_train.py: ``elu(x) + 1`` and linear attention as one
differentiable operator whose backward runs the map's backward on the blocks of its products) against the plain
torch expressions (float64, outputs and gradients, with torch.autograd), the unfused operators it replaces (the same
results to rounding) and the torch backend.

Padded keys hold NaN/Inf and must not reach a value or a gradient; lengths are not multiples of the block; a state
is carried in (with gradients) and out.
"""

from __future__ import annotations

import pytest
import torch
from comparisons import elu_linear_causal, module_run

import attnkit
from attnkit_kernelized.common import padded
from attnkit_kernelized.linear.module import LinearAttention
from attnkit_kernelized.linear.numba_train import linear_causal


def _inputs(dtype, L, with_state):
    g = torch.Generator().manual_seed(3)
    B, H, D, E = 2, 3, 8, 5
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=dtype) * 2 for _ in range(2))
    v = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, max(0, L - 5):] = False
    kpm[0, L // 2] = False
    S0 = torch.rand(B, H, D, E, generator=g, dtype=dtype) if with_state else torch.zeros(B, H, D, E, dtype=dtype)
    z0 = torch.rand(B, H, D, generator=g, dtype=dtype) + 0.5 if with_state else torch.zeros(B, H, D, dtype=dtype)
    return q, k, v, kpm, S0, z0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("L,chunk", [(1, 32), (37, 32), (70, 16), (45, 4)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.6])
def test_outputs_and_gradients_equal_the_torch_expressions(dtype, tol, L, chunk, with_state, scale):
    q, k, v, kpm, S0, z0 = _inputs(dtype, L, with_state)
    pad = padded(kpm)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, L - 1] = float("nan")           # padded keys hold anything; the module zeroes v there
    if L > 1:
        k_bad[1, :, L - 2] = float("inf")
    v_bad.masked_fill_(pad, 0.0)
    ins = [t.clone().requires_grad_() for t in (q, k_bad, v_bad, S0, z0)]
    out, S, z = linear_causal(ins[0], ins[1], ins[2], scale, pad, ins[3], ins[4], chunk)
    g = torch.Generator().manual_seed(4)
    go, gS, gz = (torch.randn(t.shape, generator=g, dtype=dtype) for t in (out, S, z))
    grads = torch.autograd.grad((out * go).sum() + (S * gS).sum() + (z * gz).sum(), ins)

    ref_ins = [t.clone().requires_grad_() for t in (q, k.masked_fill(pad, 0.0), v_bad, S0, z0)]
    r_out, r_S, r_z = elu_linear_causal(ref_ins[0], ref_ins[1], ref_ins[2], scale, pad, ref_ins[3], ref_ins[4])
    r_grads = torch.autograd.grad((r_out * go).sum() + (r_S * gS).sum() + (r_z * gz).sum(), ref_ins)
    for name, a, b in [("out", out, r_out), ("S", S, r_S), ("z", z, r_z),
                       *(("d" + n, x, y) for n, x, y in zip(("q", "k", "v", "S0", "z0"), grads, r_grads))]:
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    # a padded key's gradient is 0 whatever it holds (it enters nothing)
    assert (grads[1].masked_select(pad) == 0).all()
    assert (grads[2].masked_select(pad) == 0).all()


def test_gradcheck():
    """Small sizes (B = 1, H = 2, L = 7, D = 4, E = 3: gradcheck calls the operator twice per input element),
    inputs on both sides of the map's kink, a padded key, a state in, blocks of 4, a scale."""
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 7, 3, generator=g, dtype=torch.float64)
    S0 = torch.rand(1, 2, 4, 3, generator=g, dtype=torch.float64)
    z0 = torch.rand(1, 2, 4, generator=g, dtype=torch.float64) + 0.5
    kpm = torch.ones(1, 7, dtype=torch.bool)
    kpm[0, 5] = False
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)

    def fn(q, k, v, S0, z0):
        return linear_causal(q, k, v, 0.8, pad, S0, z0, 4)

    assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (q, k, v, S0, z0)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L,split", [(37, 0), (70, 0), (50, 20)])
@pytest.mark.parametrize("scale", [None, 0.4])
def test_the_module_trains_through_it_with_the_unfused_operators_results(monkeypatch, dtype, L, split, scale):
    """The module's numba path under autograd runs the operator (counted) and gives what the unfused operators
    (the map, then linear attention) give, to rounding; and what the torch backend gives. A state is carried from
    one call to the next (with its gradient)."""
    torch.manual_seed(0)
    m = attnkit.build("linear", num_heads=2, backend="numba", chunk_size=16, scale=scale)
    q, k, v = (torch.randn(2, 2, L, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, -5:] = False
    kpm[0, 3] = False
    calls = []
    trained = LinearAttention._trained_causal

    def counted(self, *args):
        res = trained(self, *args)
        calls.append(res is not None)
        return res

    monkeypatch.setattr(LinearAttention, "_trained_causal", counted)
    out, grads = module_run(m, q, k, v, kpm, split)
    assert calls == [True] * (2 if split else 1)
    monkeypatch.setattr(LinearAttention, "_trained_causal", lambda *args: None)
    out_u, grads_u = module_run(m, q, k, v, kpm, split)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out, out_u, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_u):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    mt = attnkit.build("linear", num_heads=2, backend="torch", chunk_size=16, scale=scale)
    out_t, grads_t = module_run(mt, q, k, v, kpm, split)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out, out_t, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_t):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_padded_keys_have_no_influence_whatever_they_hold():
    """Through the module, under autograd: a padded key holding NaN, Inf or 1e30 in k and v changes no output and
    no gradient of another position, and its own gradients are 0."""
    torch.manual_seed(2)
    m = attnkit.build("linear", backend="numba", chunk_size=8)
    q, k, v = (torch.randn(1, 2, 21, 8, dtype=torch.float64) for _ in range(3))
    kpm = torch.ones(1, 21, dtype=torch.bool)
    kpm[0, 9] = False
    results = []
    for bad in (0.0, float("nan"), float("inf"), 1e30):
        ins = [t.clone() for t in (q, k, v)]
        for t in ins[1:]:
            t[0, :, 9] = bad
        ins = [t.requires_grad_() for t in ins]
        out = m(*ins, causal=True, key_padding_mask=kpm)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), ins)
        assert (grads[1][0, :, 9] == 0).all() and (grads[2][0, :, 9] == 0).all()
        results.append((out, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_opcheck():
    """The operators' schemas, fake (meta) functions and autograd registrations agree with what they do
    (``torch.library.opcheck``: also traced by AOT autograd with dynamic shapes)."""
    from attnkit_kernelized.linear.numba_ops import numba_linear_product_elu
    from attnkit_kernelized.linear.numba_train import numba_linear_causal

    q, k, v, kpm, S0, z0 = _inputs(torch.float64, 13, True)
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(numba_linear_causal, (*ins, 0.5, pad, S0.clone().requires_grad_(),
                                                z0.clone().requires_grad_(), 4))
    torch.library.opcheck(numba_linear_causal, (q, k, v, 1.0, None, S0, z0, 4))
    N, L, M, E = 6, 13, q.shape[-1], v.shape[-1]
    x = torch.randn(N, L, E + 1, dtype=torch.float64)
    f = torch.rand(N, L, M, dtype=torch.float64) * 2
    torch.library.opcheck(numba_linear_product_elu,
                          (x, x.flip(1), f, torch.rand(N, E + 1, M, dtype=torch.float64),
                           torch.zeros(N, E + 1, dtype=torch.float64), True, 4, f.flip(1), 0.5))
