"""float16 and bfloat16 inputs on the low-rank modules: float32 inside, the output and gradients in the input dtype.

q, k and v are upcast at the module boundary (``common.Float32Inside``): the pseudo-inverses, pooled and landmark
softmaxes and hashing run their float32 code and the output is cast back. Compared with each spec's float64 plain
reference on the same (rounded) inputs at the kit's half tolerances. Two ways of holding the parameters: a float32
module called with half inputs (autocast-like: float32 parameters and parameter gradients) and ``module.to(dtype)``
(half parameters, upcast per call, gradients in the half dtype). Luna's streaming state stays float32.
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.registry import default_registry

HALF = [torch.float16, torch.bfloat16]
#: the kit's half tolerances (attnkit.testing.config), against float64 on the rounded inputs
HALF_TOL = {torch.float16: dict(atol=3e-3, rtol=3e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
B, H, L, D, E = 2, 2, 9, 4, 3

MECHANISMS = [
    ("nystrom", {"num_landmarks": 3}),
    ("nystrom", {"num_landmarks": 4, "pinv_iterations": 3, "conv_kernel_size": 3}),
    ("linformer", {"proj_len": 5, "max_length": 16}),
    ("soft", {"stride": 3}),
    ("soft", {"stride": 4, "bottleneck": "pool", "pinv_iterations": 8}),
    ("memory-compressed", {}),
    ("memory-compressed", {"stride": 2, "compression": "pool"}),
    ("informer", {"factor": 1, "chunk_size": 4}),
    ("clustered", {"clusters": 3, "bits": 8, "iterations": 3}),
    ("improved-clustered", {"clusters": 3, "bits": 8, "iterations": 3, "top_k": 3}),
    ("isab", {"num_inducing": 4, "per_head": True}),
    ("luna", {"packed_len": 4, "chunk_size": 4}),
    ("luna", {"packed_len": 3, "chunk_size": 4, "causal_form": "prefix-softmax"}),
    ("poolingformer", {"window": 4, "pool_window": 6, "pool_size": 3, "pool_stride": 2, "chunk_size": 3}),
]
#: key padding where declared; nystrom's convolution residual reads neighbouring (zeroed) values, so a padded
#: key is a zero value there, not absent (as in tests/test_conformance.py)
PADDED = [(n, o) for n, o in MECHANISMS
          if attnkit.get_spec(n).capabilities.key_padding_mask and "conv_kernel_size" not in o]


def build(name, dtype, **opts):
    torch.manual_seed(0)
    attn = default_registry().build_with_hints(name, {"num_heads": H, "head_dim": D, "value_dim": E}, **opts)
    return attn.to(dtype)


def _modes(name):
    caps = attnkit.get_spec(name).capabilities
    return [c for c, ok in ((False, caps.noncausal), (True, caps.causal)) if ok]


def _inputs(dtype, b=B, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, H, L, w, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for w in (D, D, E)]


def _reference(attn, q, k, v, causal, kpm=None):
    """The spec's plain reference in float64 on the upcast inputs, with the module's own parameters upcast
    (exactly: half and float32 values are float64 values)."""
    ref_attn = copy.deepcopy(attn).double()
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = masks.resolve(None, causal=causal, key_padding_mask=kpm)
    out = attnkit.get_spec(attn.spec.name).load_reference()(ref_attn, *ins, mask=mask, positions=None)
    return out, ins, ref_attn


def _weights(out):
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _close_grads(got, want, dtype, names):
    tol = HALF_TOL[dtype]
    for n, a, b in zip(names, got, want, strict=True):
        if a is None:
            assert b is None or not b.any(), n
            continue
        assert a.dtype == dtype and torch.isfinite(a).all(), n
        b = torch.zeros(a.shape, dtype=torch.float64) if b is None else b
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=tol["atol"] * 10 * scale, rtol=tol["rtol"] * 10, msg=n)


def _check(attn, dtype, causal, kpm=None):
    q, k, v = _inputs(dtype)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert out.dtype == dtype and torch.isfinite(out).all()
    want, ins, _ = _reference(attn, q, k, v, causal, kpm)
    torch.testing.assert_close(out.double(), want, **HALF_TOL[dtype])
    w = _weights(want)
    got = torch.autograd.grad((out.double() * w).sum(), [q, k, v])
    exp = torch.autograd.grad((want * w).sum(), ins)
    _close_grads(got, exp, dtype, "qkv")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_float32_module_with_half_inputs(name, opts, dtype):
    """A float32 module on half inputs (autocast-like): output and input gradients in the input dtype, close to
    float64, every declared mode; the parameters stay float32 and so do their gradients."""
    attn = build(name, torch.float32, **opts)
    for causal in _modes(name):
        _check(attn, dtype, causal)
    params = [p for p in attn.parameters() if p.requires_grad]
    if params:
        q, k, v = _inputs(dtype)
        out = attn(q, k, v, causal=_modes(name)[0])
        grads = torch.autograd.grad(out.float().sum(), params, allow_unused=True)
        assert any(g is not None for g in grads)
        for p, g in zip(params, grads, strict=True):
            assert p.dtype == torch.float32
            assert g is None or (g.dtype == torch.float32 and torch.isfinite(g).all())


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_half_module(name, opts, dtype):
    """``module.to(dtype)``: parameters in the half dtype, upcast per call; the output and input gradients in the
    input dtype, close to float64 with the module's own (rounded) parameters; the parameter gradients in the half
    dtype and close to the reference's."""
    attn = build(name, dtype, **opts)
    for pname, p in attn.named_parameters():
        assert p.dtype == dtype, pname
    for causal in _modes(name):
        _check(attn, dtype, causal)
    names = [n for n, p in attn.named_parameters() if p.requires_grad]
    if not names:
        return
    causal = _modes(name)[0]
    q, k, v = _inputs(dtype)
    out = attn(q, k, v, causal=causal)
    want, _, ref_attn = _reference(attn, q, k, v, causal)
    w = _weights(want)
    got = torch.autograd.grad((out.double() * w).sum(), [dict(attn.named_parameters())[n] for n in names],
                              allow_unused=True)
    exp = torch.autograd.grad((want * w).sum(), [dict(ref_attn.named_parameters())[n] for n in names],
                              allow_unused=True)
    assert any(g is not None for g in got)
    _close_grads(got, exp, dtype, names)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,opts", PADDED, ids=str)
def test_padding_in_half(name, opts, dtype):
    """Key padding in half: close to the reference (outputs, gradients); NaN / Inf at padded keys and values change
    nothing; a batch row whose every key is padded gives finite zeros."""
    attn = build(name, torch.float32, **opts)
    kpm = torch.ones(3, L, dtype=torch.bool)
    kpm[1, 5:] = False
    kpm[2] = False                                       # batch 2: every key padded
    pad = ~kpm[:, None, :, None]
    for causal in _modes(name):
        _check(attn, dtype, causal, kpm=kpm[:2])
        q, k, v = (t.detach() for t in _inputs(dtype, b=3))
        base = attn(q, k, v, causal=causal, key_padding_mask=kpm)
        assert base.dtype == dtype and torch.isfinite(base).all() and (base[2] == 0).all()
        for fill in (float("nan"), float("inf"), float("-inf")):
            out = attn(q, k.masked_fill(pad, fill), v.masked_fill(pad, fill), causal=causal, key_padding_mask=kpm)
            torch.testing.assert_close(out, base, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("module_dtype", ["float32", "half"])
def test_luna_state_in_half_stays_float32(module_dtype, dtype):
    """Luna's returned packed sequence is float32 on half inputs (a float32 or half module); passed on
    (``forward(state=...)`` and ``step``) it gives outputs in the input dtype, close to the float64 computation
    on the same inputs and state."""
    attn = build("luna", torch.float32 if module_dtype == "float32" else dtype, packed_len=4, chunk_size=4)
    ref = copy.deepcopy(attn).double()
    q, k, v = (t.detach() for t in _inputs(dtype))
    tol = HALF_TOL[dtype]
    for causal in (False, True):
        out, st = attn(q, k, v, causal=causal, return_state=True)
        want, want_st = ref(q.double(), k.double(), v.double(), causal=causal, return_state=True)
        assert out.dtype == dtype and st.data.dtype == torch.float32
        torch.testing.assert_close(out.double(), want, **tol)
        torch.testing.assert_close(st.data.double(), want_st.data, **tol)
        nxt, st2 = attn(q, k, v, causal=causal, state=st, return_state=True)
        want_nxt = ref(q.double(), k.double(), v.double(), causal=causal,
                       state=attnkit.AttentionState(st.owner, B, torch.float64, st.device, st.data.double()))
        assert nxt.dtype == dtype and st2.data.dtype == torch.float32
        torch.testing.assert_close(nxt.double(), want_nxt, **tol)
    s0 = attn.init_state(B, dtype=dtype)
    o1, s1 = attn.step(q[:, :, :3], k[:, :, :3], v[:, :, :3], s0)
    assert o1.dtype == dtype and s1.data.dtype == torch.float32
    torch.testing.assert_close(o1.double(), ref(q[:, :, :3].double(), k[:, :, :3].double(), v[:, :, :3].double(),
                                                causal=True), **tol)


def test_float32_buffers_none_and_round_trip():
    """No module here keeps a buffer (random hyperplanes and samples are drawn per call in float64): ``.to(half)``
    casts parameters only, and ``.double()`` after it gives the same (rounded) values; the state dict loads
    across dtypes."""
    for name, opts in MECHANISMS:
        attn = build(name, torch.float32, **opts)
        assert not list(attn.buffers()), name
        half = copy.deepcopy(attn).to(torch.bfloat16)
        back = copy.deepcopy(half).double()
        for (n, p), (_, r) in zip(half.named_parameters(), back.named_parameters(), strict=True):
            assert r.dtype == torch.float64 and torch.equal(p.double(), r), (name, n)
        other = build(name, torch.float16, **opts)
        other.load_state_dict(attn.state_dict())
        for (n, p), (_, r) in zip(attn.named_parameters(), other.named_parameters(), strict=True):
            assert torch.equal(p.half(), r), (name, n)


@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_the_float32_path_runs(name, opts):
    """The mechanism itself sees float32 q, k, v for half inputs (a spy on ``_attend``): the pseudo-inverses,
    pooled softmaxes and hashing never run in half; float32 and float64 inputs pass through unchanged."""
    attn = build(name, torch.bfloat16, **opts)
    seen = []
    real = attn._attend
    attn._attend = lambda q, k, v, ctx: seen.append((q.dtype, k.dtype, v.dtype)) or real(q, k, v, ctx)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        seen.clear()
        q, k, v = (t.detach() for t in _inputs(dtype))
        assert attn(q, k, v, causal=_modes(name)[0]).dtype == dtype
        inner = torch.float32 if dtype in HALF else dtype
        assert seen == [(inner, inner, inner)]


@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_float16_scores_beyond_its_range(name, opts):
    """float16 inputs whose scores exceed float16's range (entries ~200: scaled scores up to ~1e5 > 65504): finite,
    and close to the float64 reference (computed in float16 the scores overflow to inf: NaN or wrong outputs)."""
    attn = build(name, torch.float32, **opts)
    g = torch.Generator().manual_seed(5)
    q, k = ((200 * torch.randn(B, H, L, D, generator=g)).half() for _ in range(2))
    v = torch.randn(B, H, L, E, generator=g).half()
    for causal in _modes(name):
        out = attn(q, k, v, causal=causal)
        assert out.dtype == torch.float16 and torch.isfinite(out).all()
        want, _, _ = _reference(attn, q, k, v, causal)
        torch.testing.assert_close(out.double(), want, **HALF_TOL[torch.float16])
