"""float16 and bfloat16 inputs on the modules: the output and the gradients in the input dtype, features, states and
normalisers in float32 inside (numba and torch upcast; triton reads half features and values with float32
accumulators and states), close to the float64 reference on the same (rounded) inputs.

Two ways of holding the parameters: ``module.float()`` called with half inputs (autocast-like: float32 parameters),
and ``module.to(dtype)`` (half parameters, upcast per call; the random projections stay float32). Streaming in half
keeps a float32 state. The triton backend runs under ``TRITON_INTERPRET=1`` (the ``triton`` mark) in both half
dtypes: the kernels convert their half inputs to float32 before every ``tl.dot`` (the interpreter's bfloat16 dot is
broken), so the interpreter runs bfloat16 as a GPU does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from comparisons import TRITON, backends, build, grads, padding, rand

import attnkit
from attnkit import masks

HALF = [torch.float16, torch.bfloat16]
#: the kit's half tolerances (attnkit.testing.config), against float64 on the rounded inputs
HALF_TOL = {torch.float16: dict(atol=3e-3, rtol=3e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

MECHANISMS = [("linear", {}), ("linear", {"feature_map": "dpfp"}), ("performer", {"num_features": 16}),
              ("performer", {"num_features": 16, "feature_map": "generalized"}), ("rfa", {"num_features": 8}),
              ("rfa", {"num_features": 8, "feature_map": "positive"}), ("fast-weight", {}),
              ("fast-weight", {"feature_map": "elu", "beta": 0.5})]


def _modes(name):
    caps = attnkit.get_spec(name).capabilities
    return [c for c, ok in ((True, caps.causal), (False, caps.noncausal)) if ok]


def _inputs(dtype, L=9, S=9, B=2, std=0.5):
    return [rand(s, seed, torch.float64, std=std).detach().to(dtype).requires_grad_()
            for s, seed in (((B, 2, L, 4), 1), ((B, 2, S, 4), 2), ((B, 2, S, 3), 3))]


def _reference(attn, q, k, v, causal, kpm=None):
    """The spec's naive reference in float64 on the upcast half inputs, with the module's own parameters and
    features upcast (exactly: half and float32 values are float64 values)."""
    ref_attn = copy.deepcopy(attn).double()
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = masks.resolve(None, causal=causal, key_padding_mask=kpm)
    out = attnkit.get_spec(attn.spec.name).load_reference()(ref_attn, *ins, mask=mask, positions=None)
    return out, ins


def _check(attn, dtype, causal, kpm=None, std=0.5):
    q, k, v = _inputs(dtype, std=std)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert out.dtype == dtype and torch.isfinite(out).all()
    want, ins = _reference(attn, q, k, v, causal, kpm)
    tol = HALF_TOL[dtype]
    torch.testing.assert_close(out.double(), want, **tol)
    got_g = grads([out], [q, k, v])
    want_g = grads([want], ins)
    for a, b in zip(got_g, want_g, strict=True):
        assert a.dtype == dtype and torch.isfinite(a).all()
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=tol["atol"] * 10 * scale, rtol=tol["rtol"] * 10)
    return out


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("backend", backends("torch", "numba"))
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_float32_module_with_half_inputs(name, opts, backend, dtype):
    """``module.float()`` on half inputs (autocast-like): output and gradients in the input dtype, close to float64;
    the parameters' gradients stay float32."""
    attn = build(name, torch.float32, backend=backend, chunk_size=4, **opts)
    for causal in _modes(name):
        _check(attn, dtype, causal)
    params = [p for p in attn.parameters() if p.requires_grad]
    if params:
        q, k, v = _inputs(dtype)
        out = attn(q, k, v, causal=True)
        for g in torch.autograd.grad(out.float().sum(), params, allow_unused=True):
            assert g is None or (g.dtype == torch.float32 and torch.isfinite(g).all())


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("backend", backends("torch", "numba"))
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_half_module(name, opts, backend, dtype):
    """``module.to(dtype)``: parameters in the half dtype (their gradients too), random projections kept float32;
    the output and input gradients in the input dtype, close to float64 with the module's own (rounded) parameters."""
    attn = build(name, dtype, backend=backend, chunk_size=4, **opts)
    for pname, p in attn.named_parameters():
        assert p.dtype == dtype, pname
    for bname in type(attn).float32_buffers:
        buf = getattr(attn, bname)
        if isinstance(buf, torch.Tensor) and bname in dict(attn.named_buffers()):
            assert buf.dtype == torch.float32, bname
    for causal in _modes(name):
        _check(attn, dtype, causal)
    params = [p for p in attn.parameters() if p.requires_grad]
    if params:
        q, k, v = _inputs(dtype)
        out = attn(q, k, v, causal=True)
        for g in torch.autograd.grad(out.float().sum(), params, allow_unused=True):
            assert g is None or (g.dtype == dtype and torch.isfinite(g).all())


def test_random_projections_stay_float32_and_round_trip():
    """``.to(bfloat16)`` keeps performer's and rfa's random features exactly; ``.double()`` after it gives them in
    float64 (the same values); the state dict loads across dtypes."""
    for name, opts in (("performer", {"num_features": 8}), ("rfa", {"num_features": 8, "learn_sigma": False})):
        attn = build(name, torch.float32, **opts)
        w = attn.features.clone()
        half = attn.to(torch.bfloat16)
        assert half.features.dtype == torch.float32 and torch.equal(half.features, w)
        if name == "rfa":
            assert half.log_sigma.dtype == torch.float32
        assert half.double().features.dtype == torch.float64
        other = build(name, torch.float32, **{**opts, "seed": 5}).to(torch.float16)
        other.load_state_dict(attn.state_dict())
        assert torch.equal(other.features, w)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("backend", backends("torch", "numba"))
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_padding_garbage_and_fully_masked_rows_in_half(name, opts, backend, dtype):
    """NaN / Inf at padded keys change nothing; a batch row whose every key is padded gives zeros, in half."""
    attn = build(name, torch.float32, backend=backend, chunk_size=4, **opts)
    kpm = padding(3, 9)
    kpm[2] = False                                       # batch 2: every key padded
    pad = ~kpm[:, None, :, None]
    for causal in _modes(name):
        q, k, v = _inputs(dtype, B=3)
        base = attn(q, k, v, causal=causal, key_padding_mask=kpm)
        assert base.dtype == dtype and torch.isfinite(base).all() and (base[2] == 0).all()
        for fill in (float("nan"), float("inf"), float("-inf")):
            k2 = k.detach().masked_fill(pad, fill)
            v2 = v.detach().masked_fill(pad, fill)
            out = attn(q, k2, v2, causal=causal, key_padding_mask=kpm)
            torch.testing.assert_close(out, base, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("backend", backends("torch", "numba"))
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_streaming_in_half_keeps_a_float32_state(name, opts, backend, dtype):
    """``step`` and ``forward(state=..., return_state=True)`` on half inputs: float32 state tensors, outputs in the
    input dtype equal to the causal forward (the same float32 computation, rounded once)."""
    attn = build(name, torch.float32, backend=backend, chunk_size=4, **opts)
    q, k, v = (t.detach() for t in _inputs(dtype))
    full = attn(q, k, v, causal=True)
    state = attn.init_state(2, dtype=dtype)
    outs = []
    for s in range(0, 9, 3):
        out, state = attn.step(q[:, :, s:s + 3], k[:, :, s:s + 3], v[:, :, s:s + 3], state)
        assert out.dtype == dtype
        outs.append(out)
    for t in state.data.values():
        assert t.dtype == torch.float32
    tol = HALF_TOL[dtype]
    torch.testing.assert_close(torch.cat(outs, dim=2).float(), full.float(), **tol)
    out_a, st = attn(q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, return_state=True)
    out_b, st = attn(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], causal=True, state=st, return_state=True)
    assert out_a.dtype == out_b.dtype == dtype
    assert all(t.dtype == torch.float32 for t in st.data.values())
    torch.testing.assert_close(torch.cat([out_a, out_b], dim=2).float(), full.float(), **tol)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_performer_large_exponents_in_half(dtype):
    """Performer's causal positive map on inputs of large norm in half: the log-space torch form runs (in float32)
    and stays close to float64; numba and torch agree."""
    for backend in ("torch", "numba"):
        attn = build("performer", torch.float32, backend=backend, chunk_size=4, num_features=16)
        _check(attn, dtype, True, std=4.0)


# ------------------------------------------------------------------ triton (interpreter): float16
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
# each half dtype with one way of holding the parameters (both ways with both dtypes run on torch and numba,
# above): which way only changes the module's casts before the kernels, so the pairs halve the interpreter's
# time without leaving a kernel input dtype or a module form untested
@pytest.mark.parametrize("dtype,module_dtype", [(torch.float16, "float32"), (torch.bfloat16, "half")], ids=str)
@pytest.mark.parametrize("triton", [pytest.param(True, marks=TRITON)], ids=["triton"])
def test_triton_module_half(name, opts, dtype, module_dtype, triton):
    """The module path on the triton backend with half inputs (float16 on a float32 module, bfloat16 on a module
    cast to bfloat16): the kernels read half features and values (float32 accumulators and states; they convert
    before ``tl.dot``, so bfloat16 runs in the interpreter too); output and gradients in the input dtype, close to
    float64, also with key padding; streaming keeps a float32 state."""
    attn = build(name, torch.float32 if module_dtype == "float32" else dtype, backend="triton", chunk_size=4, **opts)
    kpm = padding(2, 9)
    for causal in _modes(name):
        _check(attn, dtype, causal)
        _check(attn, dtype, causal, kpm=kpm)
    q, k, v = (t.detach() for t in _inputs(dtype))
    out, st = attn(q, k, v, causal=True, return_state=True)
    assert out.dtype == dtype and all(t.dtype == torch.float32 for t in st.data.values())


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("triton", [pytest.param(True, marks=TRITON)], ids=["triton"])
def test_triton_performer_half_paths(triton, dtype, monkeypatch):
    """Which causal path performer runs on triton for half inputs: the bounded-exponent path on the linear kernels
    (bfloat16 features; float32 features with float16 values for float16, whose range would hold exponents of
    +-9 only) while every key exponent lies within +-60, else the log-space torch form in float32; both close
    to float64."""
    from attnkit_kernelized.linear import triton_ops
    from attnkit_kernelized.performer import module as pmod

    calls, feature_dtypes = [], []
    real, real_op = pmod.log_space_causal, triton_ops.linear_attention
    monkeypatch.setattr(pmod, "log_space_causal", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(triton_ops, "linear_attention",
                        lambda phi_q, *a, **kw: feature_dtypes.append(phi_q.dtype) or real_op(phi_q, *a, **kw))
    attn = build("performer", torch.float32, backend="triton", chunk_size=4, num_features=16)
    _check(attn, dtype, True, std=4.0)
    assert not calls, "exponents within +-60: the bounded path on the linear kernels"
    assert set(feature_dtypes) == {torch.float32 if dtype == torch.float16 else dtype}
    _check(attn, dtype, True, std=12.0)
    assert calls, "exponents beyond +-60: the log-space form"


@pytest.mark.parametrize("name,opts", [("performer", {"num_features": 8}), ("fast-weight", {})], ids=str)
def test_compile_fullgraph_half(name, opts):
    """torch.compile(fullgraph=True) of a module on the numba backend called with bfloat16 inputs: no graph break
    (the half route is plain tensor casts), the output and gradients equal eager's."""
    attn = build(name, torch.float32, backend="numba", **opts)
    q, k, v = _inputs(torch.bfloat16)
    eager = attn(q, k, v, causal=True)
    g_eager = grads([eager], [q, k, v])
    torch._dynamo.reset()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)
    for a, b in zip(grads([out], [q, k, v]), g_eager, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
