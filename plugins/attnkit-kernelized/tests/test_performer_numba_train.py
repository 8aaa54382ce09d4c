"""The performer's causal training operator (performer/numba_train.py: features and linear attention as one
differentiable operator whose backward runs the features' backward on the blocks of its products) against the
plain torch expressions (float64, outputs and gradients, with torch.autograd), the unfused operators it replaces
(the same results) and the torch backend; and the backward's one-pass inputs (``numba_linear_backward_inputs``)
against the torch expressions they replace.

Padded keys hold NaN/Inf and must not reach a value or a gradient; lengths are not multiples of the block; a state
is carried in (with gradients) and out.
"""

from __future__ import annotations

import pytest
import torch
from comparisons import module_run

import attnkit
from attnkit_kernelized.common import padded
from attnkit_kernelized.linear.numba_ops import numba_linear_backward_inputs
from attnkit_kernelized.performer.module import PerformerAttention
from attnkit_kernelized.performer.numba_train import performer_causal


def _torch_causal(q, k, v, w, scale, pad, S0, z0):
    """Positive features (queries shifted by their row maximum, detached) and causal normalised linear attention
    from ``(S0, z0)`` as an explicit masked product: what the operator computes, in plain torch."""
    pq = q @ w.T
    phi_q = torch.exp(pq - pq.detach().amax(-1, keepdim=True))
    phi_k = torch.exp(k @ w.T - 0.5 * scale * (k * k).sum(-1, keepdim=True))
    if pad is not None:
        phi_k = phi_k.masked_fill(pad, 0.0)
    A = (phi_q @ phi_k.transpose(-1, -2)).tril()
    num = A @ v + phi_q @ S0
    den = A.sum(-1) + (phi_q * z0.unsqueeze(-2)).sum(-1)
    empty = (den == 0).unsqueeze(-1)         # no key seen: 0, and no gradient through the division
    out = torch.where(empty, torch.zeros_like(num), num / torch.where(empty, torch.ones_like(num), den.unsqueeze(-1)))
    return out, S0 + phi_k.transpose(-1, -2) @ v, z0 + phi_k.sum(-2)


def _inputs(dtype, L, with_state):
    g = torch.Generator().manual_seed(3)
    B, H, D, M, E = 2, 3, 8, 24, 5
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    w = torch.randn(M, D, generator=g, dtype=dtype) * 0.6
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, max(0, L - 5):] = False
    kpm[0, L // 2] = False
    S0 = torch.rand(B, H, M, E, generator=g, dtype=dtype) if with_state else torch.zeros(B, H, M, E, dtype=dtype)
    z0 = torch.rand(B, H, M, generator=g, dtype=dtype) + 0.5 if with_state else torch.zeros(B, H, M, dtype=dtype)
    return q, k, v, w, kpm, S0, z0


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("L,chunk", [(1, 32), (37, 32), (70, 16), (45, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_outputs_and_gradients_equal_the_torch_expressions(dtype, tol, L, chunk, with_state):
    q, k, v, w, kpm, S0, z0 = _inputs(dtype, L, with_state)
    pad = padded(kpm)
    scale = 0.7
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, L - 1] = float("nan")           # padded keys hold anything; the module zeroes v there
    v_bad.masked_fill_(pad, 0.0)
    ins = [t.clone().requires_grad_() for t in (q, k_bad, v_bad, S0, z0)]
    out, S, z, hi, lo = performer_causal(ins[0], ins[1], ins[2], w, scale, pad, ins[3], ins[4], chunk)
    g = torch.Generator().manual_seed(4)
    go, gS, gz = torch.randn(out.shape, generator=g, dtype=dtype), torch.randn(S.shape, generator=g, dtype=dtype), \
        torch.randn(z.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad((out * go).sum() + (S * gS).sum() + (z * gz).sum(), ins)

    ref_ins = [t.clone().requires_grad_() for t in (q, k.masked_fill(pad, 0.0), v_bad, S0, z0)]
    r_out, r_S, r_z = _torch_causal(ref_ins[0], ref_ins[1], ref_ins[2], w, scale, pad, ref_ins[3], ref_ins[4])
    r_grads = torch.autograd.grad((r_out * go).sum() + (r_S * gS).sum() + (r_z * gz).sum(), ref_ins)
    for name, a, b in [("out", out, r_out), ("S", S, r_S), ("z", z, r_z),
                       *(("d" + n, x, y) for n, x, y in zip(("q", "k", "v", "S0", "z0"), grads, r_grads))]:
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
    # a padded key's gradient is 0 whatever it holds (it enters nothing)
    assert (grads[1].masked_select(pad) == 0).all()
    assert (grads[2].masked_select(pad) == 0).all()
    lk = (k @ w.T - 0.5 * scale * (k * k).sum(-1, keepdim=True))
    torch.testing.assert_close(hi, lk.masked_fill(pad, float("-inf")).amax(dim=2), rtol=tol, atol=tol)
    torch.testing.assert_close(lo, lk.masked_fill(pad, float("inf")).amin(dim=(2, 3)), rtol=tol, atol=tol)


def test_gradcheck():
    """Small sizes (B = 1, H = 2, L = 7, D = 4, M = 6, E = 3: gradcheck calls the operator twice per input
    element), a padded key, a state in, blocks of 4."""
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 7, 3, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64) * 0.6
    S0 = torch.rand(1, 2, 6, 3, generator=g, dtype=torch.float64)
    z0 = torch.rand(1, 2, 6, generator=g, dtype=torch.float64) + 0.5
    kpm = torch.ones(1, 7, dtype=torch.bool)
    kpm[0, 5] = False
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)

    def fn(q, k, v, S0, z0):
        out, S, z, _, _ = performer_causal(q, k, v, w, 0.5, pad, S0, z0, 4)
        return out, S, z

    assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (q, k, v, S0, z0)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L,split", [(37, 0), (70, 0), (50, 20)])
def test_the_module_trains_through_it_with_the_unfused_operators_results(monkeypatch, dtype, L, split):
    """The module's numba path under autograd runs the operator (counted) and gives what the unfused operators
    (features, then linear attention) give, bit for bit: the same kernels in the same order; and what the torch
    backend gives, to rounding. Several segments (segment_length 16) carry the state between them."""
    torch.manual_seed(0)
    m = attnkit.build("performer", num_features=16, num_heads=2, head_dim=8, backend="numba", chunk_size=16).to(dtype)
    m.segment_length = m.trained_segment_length = 16
    q, k, v = (torch.randn(2, 2, L, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, -5:] = False
    kpm[0, 3] = False
    calls = []
    trained = PerformerAttention._trained_causal

    def counted(self, *args):
        calls.append(1)
        return trained(self, *args)

    monkeypatch.setattr(PerformerAttention, "_trained_causal", counted)
    out, grads = module_run(m, q, k, v, kpm, split)
    assert len(calls) == -(-(split or L) // 16) + (-(-(L - split) // 16) if split else 0)
    monkeypatch.setattr(PerformerAttention, "_trains_fused", lambda *args: False)
    calls.clear()
    out_u, grads_u = module_run(m, q, k, v, kpm, split)
    assert not calls
    torch.testing.assert_close(out, out_u, rtol=0, atol=0)
    for a, b in zip(grads, grads_u):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    mt = attnkit.build("performer", num_features=16, num_heads=2, head_dim=8, backend="torch", chunk_size=16).to(dtype)
    mt.load_state_dict(m.state_dict())
    out_t, grads_t = module_run(mt, q, k, v, kpm, split)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out, out_t, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_t):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_large_inputs_fall_back_to_the_log_space_form_with_gradients():
    """Key exponents beyond the bound: the operator's result is discarded for the log-space form; the output and
    gradients stay finite and agree with the torch backend."""
    torch.manual_seed(1)
    m = attnkit.build("performer", num_features=16, num_heads=2, head_dim=8, backend="numba").double()
    mt = attnkit.build("performer", num_features=16, num_heads=2, head_dim=8, backend="torch").double()
    mt.load_state_dict(m.state_dict())
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64) * 30 for _ in range(3))
    res = []
    for mod in (m, mt):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mod(*ins, causal=True)
        res.append((out, torch.autograd.grad(out.sum(), ins)))
    for a, b in zip([res[0][0], *res[0][1]], [res[1][0], *res[1][1]]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("with_g", [True, False])
def test_backward_inputs_equal_the_torch_expressions(with_g):
    """``[g / den, -(g . out) / den]``, ``[v, 1]`` and ``g / den`` in one pass, 0 where ``den`` is 0 (a query
    that saw no key), NaN where the gradient holds NaN (as the torch expressions give)."""
    g = torch.Generator().manual_seed(5)
    N, L, E = 3, 29, 7
    out, v, go = (torch.randn(N, L, E, generator=g, dtype=torch.float64) for _ in range(3))
    den = torch.rand(N, L, generator=g, dtype=torch.float64) + 0.1
    den[0, :4] = 0
    go[2, 5, 1] = float("nan")
    gp, vp, gn = numba_linear_backward_inputs(go if with_g else None, out, den, v)
    go = go if with_g else torch.zeros_like(go)
    inv = torch.where(den == 0, torch.zeros_like(den), 1 / torch.where(den == 0, torch.ones_like(den), den))
    g_num = go * inv.unsqueeze(-1)
    g_d = -(go * out).sum(-1) * inv
    torch.testing.assert_close(gn, g_num, rtol=1e-14, atol=0, equal_nan=True)
    torch.testing.assert_close(gp, torch.cat([g_num, g_d.unsqueeze(-1)], -1), rtol=1e-14, atol=0, equal_nan=True)
    torch.testing.assert_close(vp, torch.cat([v, torch.ones(N, L, 1, dtype=v.dtype)], -1), rtol=0, atol=0)
    assert (gn[0, :4] == 0).all() and (gp[0, :4] == 0).all()


@pytest.mark.parametrize("grad", [True, False])
def test_the_training_operator_segments_by_its_own_length(monkeypatch, grad):
    """Under autograd the positive map's numba form runs ``trained_segment_length`` positions a segment; a call
    with no gradient (the fused no-grad kernel declined: a state that needs none, streamed) keeps
    ``segment_length``."""
    m = attnkit.build("performer", num_features=16, num_heads=2, head_dim=8, backend="numba", chunk_size=4).double()
    m.segment_length, m.trained_segment_length = 8, 16
    seen = []
    segment = PerformerAttention._causal_segment

    def counted(self, q, *args):
        seen.append(q.shape[2])
        return segment(self, q, *args)

    monkeypatch.setattr(PerformerAttention, "_causal_segment", counted)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=grad) for _ in range(3))
    monkeypatch.setattr(PerformerAttention, "_fused_causal", lambda *args: None)
    m(q, k, v, causal=True)
    assert seen == ([16, 16, 8] if grad else [8] * 5)


def test_opcheck():
    """The operators' schemas, fake (meta) functions and autograd registrations agree with what they do
    (``torch.library.opcheck``: also traced by AOT autograd with dynamic shapes)."""
    from attnkit_kernelized.linear.numba_ops import numba_linear_product_features
    from attnkit_kernelized.performer.numba_train import numba_performer_causal

    q, k, v, w, kpm, S0, z0 = _inputs(torch.float64, 13, True)
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(numba_performer_causal, (*ins, w, 0.5, pad, S0.clone().requires_grad_(),
                                                   z0.clone().requires_grad_(), 4))
    torch.library.opcheck(numba_performer_causal, (q, k, v, w, 0.5, None, S0, z0, 4))
    N, L, M, E = 6, 13, w.shape[0], v.shape[-1]
    x = torch.randn(N, L, E + 1, dtype=torch.float64)
    f = torch.rand(N, L, M, dtype=torch.float64)
    torch.library.opcheck(numba_linear_product_features,
                          (x, x.flip(1), f, torch.rand(N, E + 1, M, dtype=torch.float64),
                           torch.zeros(N, E + 1, dtype=torch.float64), True, 4, f.flip(1), w,
                           k.reshape(N, L, -1), kpm.repeat_interleave(3, 0), 0.5))
    den = torch.rand(N, L, dtype=torch.float64)
    torch.library.opcheck(numba_linear_backward_inputs, (x[..., :E], x[..., 1:], den, x[..., :E].flip(1)))
