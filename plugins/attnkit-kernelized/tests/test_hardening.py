"""Regression tests of the hardening defects: garbage at padded keys, NaN queries, empty sequences, forced
backends, on every backend and at the level of features and operators (where the base class cannot help)."""

from __future__ import annotations

import pytest
import torch
from comparisons import TRITON_READY, backends, build, padding, rand

import attnkit
from attnkit_kernelized._ops import backend_module

MECHANISMS = [("linear", {}), ("performer", {"num_features": 8}),
              ("performer", {"num_features": 8, "feature_map": "trig"}),
              ("performer", {"num_features": 8, "feature_map": "generalized"}), ("rfa", {"num_features": 8}),
              ("fast-weight", {})]
ALL = backends("torch", "numba", "triton")


def _cases(name, backend):
    """(name, causal) pairs the spec declares, or a skip when the backend is not offered."""
    caps = attnkit.get_spec(name).capabilities
    if backend not in caps.backends:
        pytest.skip(f"{name} offers {caps.backends}")
    return [c for c, ok in ((True, caps.causal), (False, caps.noncausal)) if ok]


# ------------------------------------------------------------------ garbage at padded keys
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_garbage_at_padded_keys_changes_nothing(backend, name, opts):
    """Padded keys multiplied by 10 (performer trig used to give NaN in every row), or holding 1e4, NaN, Inf or
    -Inf, leave every output and the gradient of q unchanged; k and v get finite, zero gradients there. The clean
    call and its gradient are computed once per causal mode and compared with each garbage in turn (the triton
    interpreter made five clean calls per case cost 22 s of CI)."""
    for causal in _cases(name, backend):
        attn = build(name, backend=backend, **opts)
        q, k, v = (rand((2, 2, 9, 4 if i < 2 else 3), i, torch.float64) for i in range(3))
        kpm = padding(2, 9)
        base = attn(q, k, v, causal=causal, key_padding_mask=kpm)
        (gq,) = torch.autograd.grad(base.sum(), q)
        pad = ~kpm[:, None, :, None]
        for fill in (10.0, 1e4, float("nan"), float("inf"), float("-inf")):
            what = f"causal={causal}, padded keys {'x 10' if fill == 10.0 else f'= {fill}'}"
            garbage = k.detach() * 10 if fill == 10.0 else torch.full_like(k, fill)
            k2 = torch.where(pad, garbage, k.detach()).requires_grad_()
            v2 = v.detach().masked_fill(pad, fill).requires_grad_()
            out = attn(q, k2, v2, causal=causal, key_padding_mask=kpm)
            torch.testing.assert_close(out, base, atol=0, rtol=0, msg=lambda m, w=what: f"{w}: output: {m}")
            g = torch.autograd.grad(out.sum(), (q, k2, v2))
            torch.testing.assert_close(g[0], gq, atol=0, rtol=0, msg=lambda m, w=what: f"{w}: dq: {m}")
            for t in g[1:]:
                assert torch.isfinite(t).all() and (t.masked_select(pad.expand_as(t)) == 0).all(), what


@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_features_of_padded_keys_are_zero_and_never_enter_the_stabiliser(name, opts, causal):
    """feature_pair itself (the reference, benchmarks and the modules call it with raw keys): padded keys
    x 10 or NaN give finite zero features there and leave the real keys' features unchanged."""
    attn = build(name, **opts)
    q, k = torch.randn(2, 2, 7, 4, dtype=torch.float64), torch.randn(2, 2, 7, 4, dtype=torch.float64)
    kpm = padding(2, 7)
    pad = ~kpm[:, None, :, None]
    _, want = attn.feature_pair(q, k, causal=causal, key_padding_mask=kpm)
    for garbage in (k * 10, k.masked_fill(pad, float("nan")), k.masked_fill(pad, float("inf"))):
        _, got = attn.feature_pair(q, torch.where(pad, garbage, k), causal=causal, key_padding_mask=kpm)
        assert torch.isfinite(got).all()
        assert (got.masked_select(pad.expand_as(got)) == 0).all()
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _later_position_garbage(ops, fill):
    """Causal operators: an Inf/NaN key feature at a later position (inside the same chunk) leaves the
    earlier outputs unchanged (the chunked torch forms used to mask by multiplying with 0: 0 * inf = NaN)."""
    q, k = torch.rand(1, 2, 9, 5, dtype=torch.float64), torch.rand(1, 2, 9, 5, dtype=torch.float64)
    v = torch.randn(1, 2, 9, 3, dtype=torch.float64)
    k2 = k.clone()
    k2[:, :, 6] = fill
    base, bad = ops(q, k, v), ops(q, k2, v)
    torch.testing.assert_close(bad[:, :, :6], base[:, :, :6], atol=0, rtol=0)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("fill", [float("inf"), float("nan")])
def test_later_garbage_stays_in_the_future_linear(backend, fill):
    mod = backend_module("linear", backend)
    _later_position_garbage(lambda q, k, v: mod.linear_attention(q, k, v, causal=True, chunk=16)[0], fill)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("fill", [float("inf"), float("nan")])
def test_later_garbage_stays_in_the_future_gated(backend, fill):
    gated = backend_module("rfa", backend)
    log_g = torch.log(torch.full((1, 2, 9), 0.9, dtype=torch.float64))
    _later_position_garbage(lambda q, k, v: gated.gated_attention(q, k, v, log_g, chunk=16)[0], fill)


# ------------------------------------------------------------------ NaN queries
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_nan_query_gives_nan_in_its_own_row_only(backend, name, opts, pad, grad):
    """NaN in, NaN out for that row only, other rows bitwise unchanged, on every backend, with or without
    padding and autograd (also a NaN query that sees no key: NaN, not 0). The rows are compared within one path:
    a call without autograd may take a fused kernel whose rounding differs from the autograd path's
    (``tests/test_*_numba_fused.py`` hold the two paths to each other)."""
    for causal in _cases(name, backend):
        attn = build(name, backend=backend, **opts)
        q, k, v = (torch.randn(2, 2, 9, 4 if i < 2 else 3, dtype=torch.float64) for i in range(3))
        kpm = padding(2, 9) if pad else None
        with torch.set_grad_enabled(grad):
            base = attn(q.clone().requires_grad_(grad), k, v, causal=causal, key_padding_mask=kpm).detach()
        for b, i in ((0, 4), (1, 0)):
            q2 = q.clone()
            q2[b, 0, i] = float("nan")
            with torch.set_grad_enabled(grad):
                out = attn(q2.requires_grad_(grad), k, v, causal=causal, key_padding_mask=kpm)
            assert torch.isnan(out[b, 0, i]).all()
            row = torch.zeros_like(out, dtype=torch.bool)
            row[b, 0, i] = True
            torch.testing.assert_close(out.detach().masked_fill(row, 0), base.masked_fill(row, 0), atol=0, rtol=0)


# ------------------------------------------------------------------ empty sequences
@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_empty_in_empty_out(backend, name, opts):
    """L = 0 or S = 0 on every backend (the base class short-circuits): empty in, empty or zero out;
    with return_state the state is unchanged."""
    caps = attnkit.get_spec(name).capabilities
    for causal in _cases(name, backend):
        attn = build(name, backend=backend, **opts)
        shapes = [(0, 0)] + ([(5, 0), (0, 5)] if not causal and caps.cross else [])
        for L, S in shapes:
            q = torch.randn(2, 2, L, 4, dtype=torch.float64, requires_grad=True)
            k = torch.randn(2, 2, S, 4, dtype=torch.float64, requires_grad=True)
            v = torch.randn(2, 2, S, 3, dtype=torch.float64, requires_grad=True)
            out = attn(q, k, v, causal=causal, key_padding_mask=torch.ones(2, S, dtype=torch.bool))
            assert out.shape == (2, 2, L, 3) and (out == 0).all()
            out.sum().backward()
        if causal:
            out, state = attn(q, k, v, causal=True, return_state=True)
            assert out.shape == (2, 2, 0, 3) and state.position == 0


def _kernel_ops(backend):
    lin, ops = backend_module("linear", backend), []
    ops.append(lambda q, k, v, b, S0, z0: lin.linear_attention(q, k, v, S0, z0, causal=True, chunk=4))
    ops.append(lambda q, k, v, b, S0, z0: lin.linear_attention(q, k, v, S0, z0, causal=False, chunk=4))
    gated, delta = backend_module("rfa", backend), backend_module("fast_weight", backend)
    ops.append(lambda q, k, v, b, S0, z0: gated.gated_attention(q, k, v, b.log(), S0, z0, chunk=4))
    ops.append(lambda q, k, v, b, S0, z0: delta.delta_rule(q, k, v, b, S0, chunk=4))
    return ops


@pytest.mark.parametrize("backend", ALL)
def test_direct_kernel_calls_with_no_positions(backend):
    """The operators themselves with L = 0 (causal used to raise IndexError in the torch form): an empty
    output and the carried state passed through unchanged, forward and backward."""
    for op in _kernel_ops(backend):
        q, k = torch.rand(2, 2, 0, 5, dtype=torch.float64), torch.rand(2, 2, 0, 5, dtype=torch.float64)
        v, beta = torch.randn(2, 2, 0, 3, dtype=torch.float64), torch.rand(2, 2, 0, dtype=torch.float64)
        S0 = torch.rand(2, 2, 5, 3, dtype=torch.float64, requires_grad=True)
        z0 = torch.rand(2, 2, 5, dtype=torch.float64, requires_grad=True)
        out, S, *_ = op(q, k, v, beta, S0, z0)
        assert out.shape == (2, 2, 0, 3)
        torch.testing.assert_close(S, S0, atol=0, rtol=0)
        (g,) = torch.autograd.grad(out.sum() + (S * 2).sum(), S0)
        torch.testing.assert_close(g, torch.full_like(S0, 2.0))


def test_non_causal_with_no_keys_through_the_operators():
    """Non-causal L > 0, S = 0: every query sees nothing: zeros on every backend's operator."""
    for backend in ["torch", "numba"] + (["triton"] if TRITON_READY else []):
        q = torch.rand(2, 2, 4, 5, dtype=torch.float64)
        out, S, z = backend_module("linear", backend).linear_attention(
            q, q[:, :, :0], torch.randn(2, 2, 0, 3, dtype=torch.float64), causal=False)
        assert out.shape == (2, 2, 4, 3) and (out == 0).all()


@pytest.mark.parametrize("causal", [True, False])
def test_performer_features_with_no_keys(causal):
    """feature_pair with S = 0 (the non-causal key stabiliser used to take a max over nothing)."""
    attn = build("performer", num_features=8)
    phi_q, phi_k = attn.feature_pair(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), causal=causal,
                                     key_padding_mask=torch.ones(1, 0, dtype=torch.bool))
    assert phi_q.shape == (1, 2, 3, 8) and phi_k.shape == (1, 2, 0, 8)


# ------------------------------------------------------------------ forced backends
def _ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("attnkit_kernelized::")}


@pytest.mark.parametrize("backend", backends("numba", "triton"))
@pytest.mark.parametrize("name,opts", [("linear", {}),
                                       ("performer", {"num_features": 8, "feature_map": "generalized"}),
                                       ("rfa", {"num_features": 8})], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_a_forced_backend_runs_its_kernel_in_every_mode(backend, name, opts, causal):
    """backend="numba" on a non-causal call used to run torch matmuls: every mode runs the backend's
    operators now (forward and backward). (Causal performer with the positive and trig maps runs its log-space
    form on every backend: see test_performer.py; its generalized map runs the linear kernels. Causal linear on
    numba trains through its one operator, map included: linear/numba_train.py.)"""
    if backend not in attnkit.get_spec(name).capabilities.backends:
        pytest.skip(f"{name} does not offer {backend}")
    attn = build(name, backend=backend, **opts)
    q, k, v = (rand((1, 2, 7, 4 if i < 2 else 3), i, torch.float64) for i in range(3))
    ran = _ops_run(lambda: attn(q, k, v, causal=causal).sum().backward())
    kernel = f"attnkit_kernelized::{backend}_{'gated' if name == 'rfa' and causal else 'linear'}_attention"
    if name == "linear" and causal and backend == "numba":
        kernel = "attnkit_kernelized::numba_linear_causal"
    assert kernel in ran, ran


def test_auto_picks_numba_for_causal_cpu_calls_and_matmuls_for_non_causal():
    for name, opts in MECHANISMS:
        attn = build(name, **opts)
        for causal in _cases(name, "numba"):
            q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
            ran = _ops_run(lambda: attn(q, q, q, causal=causal))   # noqa: B023 - called at once
            numba_ran = any(r.startswith("attnkit_kernelized::numba_") for r in ran)
            # non-causal: two matmuls are as fast as the full-product kernel, so auto takes them;
            # causal performer with the trig map runs its log-space form (no kernel); the positive map runs
            # the kernel for bounded exponents (these inputs), the log-space form beyond
            log_space = name == "performer" and opts.get("feature_map") == "trig"
            assert numba_ran == (causal and not log_space), (name, causal, ran)


@pytest.mark.parametrize("fill", [float("inf"), float("nan")])
def test_later_garbage_stays_in_the_future_delta_numba(fill):
    """The numba delta rule (its chunked operator, and the fused kernel on raw keys) reads, for each query, only
    the keys up to its own: the chunked torch and triton forms let such a key reach its chunk's earlier outputs
    (docs/mechanisms/fast-weight.md, "What bad input gets")."""
    from attnkit_kernelized.fast_weight.numba_fused import fused_causal

    delta = backend_module("fast_weight", "numba")
    beta = torch.rand(1, 2, 9, dtype=torch.float64)
    _later_position_garbage(lambda q, k, v: delta.delta_rule(q, k, v, beta, chunk=16)[0], fill)
    _later_position_garbage(lambda q, k, v: fused_causal(q, k, v, beta, None, None)[0], fill)
