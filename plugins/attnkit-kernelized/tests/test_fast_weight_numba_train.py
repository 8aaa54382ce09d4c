"""``fast-weight``'s causal training operator (fast_weight/numba_train.py: the feature map and the delta rule as one
differentiable operator, per sequence) against the plain torch expressions (torch's map, the step form of the delta
rule, torch.autograd) in float64, outputs and gradients; and the module through it against its unfused operators
(to the bit) and the torch backend.

Padded keys hold NaN/Inf and must not reach a value or a gradient; lengths are not multiples of the block or of the
checkpoint interval; a state is carried in (with its gradient) and out; every feature map the kernels compute.
"""

from __future__ import annotations

import pytest
import torch
from comparisons import fast_weight_features, module_run

import attnkit
from attnkit_kernelized.common import padded
from attnkit_kernelized.fast_weight.module import FastWeightAttention
from attnkit_kernelized.fast_weight.numba_ops import BLOCK
from attnkit_kernelized.fast_weight.numba_train import fast_weight_causal
from attnkit_kernelized.fast_weight.recurrent import delta_rule_step

MAPS = [("dpfp", 1, True), ("dpfp", 2, False), ("elu", 1, True), ("relu", 1, True), ("softplus", 1, False)]


def _torch_causal(q, k, v, beta, pad, S0, name, nu, normalize):
    """torch's map (sum-normalised when asked; padded keys 0), then the delta rule one position at a time."""
    fq, fk = fast_weight_features(q, k, pad, name, nu, normalize)
    return delta_rule_step(fq, fk, v, beta, S0)


def _inputs(dtype, L, D=5, E=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, H = 2, 2
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    beta = torch.rand(B, H, L, generator=g, dtype=dtype)
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, max(0, L - 4):] = False
    kpm[0, L // 2] = False
    return q, k, v, beta, kpm, g


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 5e-4)])
@pytest.mark.parametrize("L,chunk", [(1, 64), (BLOCK - 3, 64), (2 * BLOCK + 5, 8), (45, 20)])
@pytest.mark.parametrize("name,nu,normalize", MAPS, ids=str)
def test_outputs_and_gradients_equal_the_torch_expressions(dtype, tol, L, chunk, name, nu, normalize):
    q, k, v, beta, kpm, g = _inputs(dtype, L)
    if not normalize:     # beta |k|^2 below 2: the update stays a contraction (float32 rounding not amplified)
        q, k, beta = q * 0.3, k * 0.3, beta * 0.1
    pad = padded(kpm)
    M = 2 * q.shape[-1] * nu if name == "dpfp" else q.shape[-1]
    S0 = torch.rand(2, 2, M, v.shape[-1], generator=g, dtype=dtype) * 0.1
    k_bad, v0 = k.clone(), v.masked_fill(pad, 0.0)     # padded keys hold anything; the module zeroes v there
    k_bad[1, :, L - 1] = float("nan")
    if L > 1:
        k_bad[1, :, L - 2] = float("inf")
    ins = [t.clone().requires_grad_() for t in (q, k_bad, v0, beta, S0)]
    out, S = fast_weight_causal(*ins[:4], pad, ins[4], chunk=chunk, feature_map=name, nu=nu, normalize=normalize)
    go, gS = torch.randn(out.shape, generator=g, dtype=dtype), torch.randn(S.shape, generator=g, dtype=dtype)
    grads = torch.autograd.grad((out * go).sum() + (S * gS).sum(), ins)

    ref = [t.clone().requires_grad_() for t in (q, k.masked_fill(pad, 0.0), v0, beta, S0)]
    r_out, r_S = _torch_causal(*ref[:4], pad, ref[4], name, nu, normalize)
    r_grads = torch.autograd.grad((r_out * go).sum() + (r_S * gS).sum(), ref)
    for what, a, b in [("out", out, r_out), ("S", S, r_S),
                       *(("d" + n, x, y) for n, x, y in zip(("q", "k", "v", "beta", "S0"), grads, r_grads))]:
        assert torch.isfinite(a).all(), what
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, what=what: f"{what}: {m}")
    # a padded key's gradients are 0 whatever it holds (it enters nothing)
    assert (grads[1].masked_select(pad) == 0).all()
    assert (grads[3].masked_select(pad[..., 0]) == 0).all()


@pytest.mark.parametrize("name,nu,normalize", [("dpfp", 1, True), ("elu", 1, False)], ids=str)
def test_gradcheck(name, nu, normalize):
    """Small sizes (B = 1, H = 1, L = 7, D = 3: gradcheck calls the operator twice per input element), a padded
    key, a state in, checkpoints every 4 positions."""
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 1, 7, 3, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 1, 7, 2, generator=g, dtype=torch.float64)
    beta = torch.rand(1, 1, 7, generator=g, dtype=torch.float64)
    M = 2 * 3 * nu if name == "dpfp" else 3
    S0 = torch.rand(1, 1, M, 2, generator=g, dtype=torch.float64) * 0.1
    kpm = torch.ones(1, 7, dtype=torch.bool)
    kpm[0, 5] = False
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)

    def fn(q, k, v, beta, S0):
        return fast_weight_causal(q, k, v, beta, pad, S0, chunk=4, feature_map=name, nu=nu, normalize=normalize)

    assert torch.autograd.gradcheck(fn, [t.clone().requires_grad_() for t in (q, k, v, beta, S0)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L,split", [(37, 0), (70, 0), (50, 20)])
@pytest.mark.parametrize("opts", [{}, {"feature_map": "elu", "scale": 0.5}], ids=str)
def test_the_module_trains_through_it_with_the_unfused_operators_results(monkeypatch, dtype, L, split, opts):
    """The module's numba path under autograd runs the operator (counted) and gives what the unfused operators
    (the map, then the delta rule) give, to the bit: the same kernels in the same order; and what the torch backend
    gives, to rounding; the learned beta's parameters get their gradients through it. Several segments
    (trained_segment_length 16) carry the state between them, and so does a second call."""
    torch.manual_seed(0)
    m = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="numba", chunk_size=8, **opts).to(dtype)
    m.trained_segment_length = 16
    q, k, v = (torch.randn(2, 2, L, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, -5:] = False
    kpm[0, 3] = False
    calls = []
    trained = FastWeightAttention._trained_causal

    def counted(self, *args):
        res = trained(self, *args)
        calls.append(res is not None)
        return res

    monkeypatch.setattr(FastWeightAttention, "_trained_causal", counted)
    out, grads = module_run(m, q, k, v, kpm, split, parameters=True)
    parts = [split, L - split] if split else [L]
    assert calls == [True] * sum(-(-p // 16) for p in parts)
    monkeypatch.setattr(FastWeightAttention, "_trained_causal", lambda *args: None)
    out_u, grads_u = module_run(m, q, k, v, kpm, split, parameters=True)
    torch.testing.assert_close(out, out_u, rtol=0, atol=0)
    for a, b in zip(grads, grads_u):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    mt = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="torch", chunk_size=8, **opts).to(dtype)
    mt.load_state_dict(m.state_dict())
    out_t, grads_t = module_run(mt, q, k, v, kpm, split, parameters=True)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    torch.testing.assert_close(out, out_t, rtol=tol, atol=tol)
    for a, b in zip(grads, grads_t):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_training_runs_one_segment_of_trained_segment_length(monkeypatch):
    """Under autograd the numba form runs ``trained_segment_length`` positions a segment (one segment boundary costs
    copies and concatenations; the features are saved whatever the segment), not ``segment_length``."""
    m = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="numba").double()
    m.segment_length, m.trained_segment_length = 8, 16
    seen = []
    segment = FastWeightAttention._causal_segment

    def counted(self, q, *args):
        seen.append(q.shape[2])
        return segment(self, q, *args)

    monkeypatch.setattr(FastWeightAttention, "_causal_segment", counted)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    m(q, k, v, causal=True).sum().backward()
    assert seen == [16, 16, 8]
    seen.clear()
    mt = attnkit.build("fast-weight", num_heads=2, head_dim=8, backend="torch").double()
    mt.segment_length, mt.trained_segment_length = 8, 16
    mt(q, k, v, causal=True).sum().backward()         # the torch form keeps segment_length
    assert seen == [8] * 5


def test_refuses_what_it_cannot_run():
    q, k, v, beta, _, _ = _inputs(torch.float64, 8)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        fast_weight_causal(q.half(), k.half(), v.half(), beta.half(), None, None, chunk=4)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        fast_weight_causal(q, k, v, beta[..., :-1], None, None, chunk=4)
    with pytest.raises(ValueError, match="feature_map"):
        fast_weight_causal(q, k, v, beta, None, None, chunk=4, feature_map="favor")
    with pytest.raises(ValueError, match="nu must lie in"):
        fast_weight_causal(q, k, v, beta, None, None, chunk=4, nu=6)
    with pytest.raises(ValueError, match="chunk"):
        fast_weight_causal(q, k, v, beta, None, None, chunk=0)


def test_opcheck():
    """The operator's schema, fake (meta) function and autograd registration agree with what it does
    (``torch.library.opcheck``: also traced by AOT autograd with dynamic shapes)."""
    from attnkit_kernelized.fast_weight.numba_train import numba_fast_weight_causal

    q, k, v, beta, kpm, g = _inputs(torch.float64, 13)
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)
    S0 = torch.rand(2, 2, 10, 4, generator=g, dtype=torch.float64) * 0.1
    ins = [t.clone().requires_grad_() for t in (q, k, v, beta)]
    torch.library.opcheck(numba_fast_weight_causal, (*ins, pad, S0.clone().requires_grad_(), 4, 0, 1, True))
    torch.library.opcheck(numba_fast_weight_causal, (q, k, v, beta, None, S0[..., :5, :], 4, 1, 1, False))
