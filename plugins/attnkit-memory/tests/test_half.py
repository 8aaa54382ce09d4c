"""float16 and bfloat16 inputs on the memory modules: float32 inside, the output and gradients in the input dtype.

q, k and v are upcast at the module boundary (``common.Float32Inside``), the float32 path runs and the output is
cast back. Compared with the float64 plain references on the same (rounded) inputs at the kit's half tolerances.
Two ways of holding the parameters: a float32 module called with half inputs (autocast-like: float32 parameters
and parameter gradients) and ``module.to(dtype)`` (half parameters, upcast per call, gradients in the half
dtype). The segment state (memory, compressed memory, slots) stays float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from attnkit_memory.compressive import naive as compressive_naive
from attnkit_memory.memory_tokens import naive as memory_tokens_naive
from attnkit_memory.transformer_xl import naive as txl_naive
from memory_helpers import build, qkv

import attnkit
from attnkit import masks

HALF = [torch.float16, torch.bfloat16]
#: the kit's half tolerances (attnkit.testing.config), against float64 on the rounded inputs
HALF_TOL = {torch.float16: dict(atol=3e-3, rtol=3e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

MECHANISMS = [
    ("transformer-xl", {"mem_len": 3, "backend": "torch"}),
    ("transformer-xl", {"mem_len": 3, "backend": "sdpa"}),
    ("compressive", {"mem_len": 2, "cmem_len": 2, "compression_rate": 2, "compression": "conv"}),
    ("compressive", {"mem_len": 2, "cmem_len": 2, "compression_rate": 2, "compression": "most_used"}),
    ("memory-tokens", {"num_memory": 3}),
]
SEGMENT_REFERENCES = {"transformer-xl": txl_naive.segment_reference,
                      "compressive": compressive_naive.segment_reference,
                      "memory-tokens": memory_tokens_naive.segment_reference}


def _inputs(dtype, N=7, B=2):
    return [t.to(dtype).requires_grad_() for t in qkv(B=B, N=N, seed=3)]


def _reference(attn, q, k, v, kpm=None):
    """The spec's plain reference in float64 on the upcast inputs, with the module's own parameters upcast
    (exactly: half and float32 values are float64 values)."""
    ref_attn = copy.deepcopy(attn).double()
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = masks.resolve(None, causal=True, key_padding_mask=kpm)
    out = attnkit.get_spec(attn.spec.name).load_reference()(ref_attn, *ins, mask=mask, positions=None)
    return out, ins, ref_attn


def _grads(out, ins):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return torch.autograd.grad((out.double() * w).sum(), ins)


def _check(attn, dtype, kpm=None):
    q, k, v = _inputs(dtype)
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    assert out.dtype == dtype and torch.isfinite(out).all()
    want, ins, _ = _reference(attn, q, k, v, kpm)
    tol = HALF_TOL[dtype]
    torch.testing.assert_close(out.double(), want, **tol)
    for a, b in zip(_grads(out, [q, k, v]), _grads(want, ins), strict=True):
        assert a.dtype == dtype and torch.isfinite(a).all()
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=tol["atol"] * 10 * scale, rtol=tol["rtol"] * 10)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_float32_module_with_half_inputs(name, opts, dtype):
    """A float32 module on half inputs (autocast-like): output and input gradients in the input dtype, close to
    float64, also with key padding; the parameters stay float32 and so do their gradients."""
    attn = build(name, torch.float32, **opts)
    _check(attn, dtype)
    _check(attn, dtype, kpm=torch.tensor([[True] * 7, [True] * 5 + [False] * 2]))
    q, k, v = _inputs(dtype)
    out = attn(q, k, v, causal=True)
    params = [p for p in attn.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.float().sum(), params, allow_unused=True)
    assert any(g is not None for g in grads)
    for p, g in zip(params, grads, strict=True):
        assert p.dtype == torch.float32
        assert g is None or (g.dtype == torch.float32 and torch.isfinite(g).all())


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_half_module(name, opts, dtype):
    """``module.to(dtype)``: parameters in the half dtype, upcast per call; the output and input gradients in the
    input dtype, close to float64 with the module's own (rounded) parameters; parameter gradients in the half
    dtype and close to the reference's."""
    attn = build(name, dtype, **opts)
    for pname, p in attn.named_parameters():
        assert p.dtype == dtype, pname
    _check(attn, dtype)
    q, k, v = _inputs(dtype)
    out = attn(q, k, v, causal=True)
    want, ins, ref_attn = _reference(attn, q, k, v)
    names = [n for n, p in attn.named_parameters() if p.requires_grad]
    got = torch.autograd.grad(out.float().sum(), [dict(attn.named_parameters())[n] for n in names],
                              allow_unused=True)
    exp = torch.autograd.grad(want.sum(), [dict(ref_attn.named_parameters())[n] for n in names], allow_unused=True)
    assert any(g is not None for g in got)
    tol = HALF_TOL[dtype]
    for n, a, b in zip(names, got, exp, strict=True):
        if a is None:
            assert b is None or not b.any(), n
            continue
        assert a.dtype == dtype and torch.isfinite(a).all(), n
        if b is None:                # memory-tokens' write projections: in the graph with a zero gradient
            b = torch.zeros(a.shape, dtype=torch.float64)
        scale = max(1.0, b.abs().max().item())
        torch.testing.assert_close(a.double(), b, atol=tol["atol"] * 10 * scale, rtol=tol["rtol"] * 10, msg=n)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_padding_garbage_and_fully_masked_rows_in_half(name, opts, dtype):
    """NaN / Inf at padded keys and values change nothing; a batch row whose every key is padded gives finite
    zeros, in half, with and without a state."""
    attn = build(name, torch.float32, **opts)
    kpm = torch.ones(3, 7, dtype=torch.bool)
    kpm[1, 4:] = False
    kpm[2] = False                                       # batch 2: every key padded
    pad = ~kpm[:, None, :, None]
    q, k, v = (t.detach() for t in _inputs(dtype, B=3))
    base = attn(q, k, v, causal=True, key_padding_mask=kpm)
    assert base.dtype == dtype and torch.isfinite(base).all() and (base[2] == 0).all()
    base_s, _ = attn(q, k, v, causal=True, key_padding_mask=kpm, return_state=True)
    assert torch.isfinite(base_s).all() and (base_s[2] == 0).all()
    for fill in (float("nan"), float("inf"), float("-inf")):
        k2, v2 = k.masked_fill(pad, fill), v.masked_fill(pad, fill)
        torch.testing.assert_close(attn(q, k2, v2, causal=True, key_padding_mask=kpm), base, atol=0, rtol=0)
        out_s, st = attn(q, k2, v2, causal=True, key_padding_mask=kpm, return_state=True)
        torch.testing.assert_close(out_s, base_s, atol=0, rtol=0)
        nxt, _ = attn(q, k, v, causal=True, state=st, return_state=True)      # the padded memory: still no NaN
        assert torch.isfinite(nxt).all()


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_streaming_in_half_keeps_a_float32_state(name, opts, dtype):
    """Segment by segment on half inputs (``forward(state=..., return_state=True)`` and ``step``): float32 state
    tensors, outputs in the input dtype, close to the float64 segment reference on the rounded inputs."""
    attn = build(name, torch.float32, **opts)
    q, k, v = (t.detach() for t in _inputs(dtype, N=8))
    want = SEGMENT_REFERENCES[name](copy.deepcopy(attn).double(), *(t.double() for t in (q, k, v)), 3)
    outs, st = [], None
    step_outs, st2 = [], attn.init_state(2, dtype=dtype)
    for s in range(0, 8, 3):
        sl = (slice(None), slice(None), slice(s, s + 3))
        o, st = attn(q[sl], k[sl], v[sl], causal=True, state=st, return_state=True)
        o2, st2 = attn.step(q[sl], k[sl], v[sl], st2)
        assert o.dtype == o2.dtype == dtype
        outs.append(o)
        step_outs.append(o2)
        for data in (st.data, st2.data):
            tensors = [t for t in data.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
            assert tensors and all(t.dtype == torch.float32 for t in tensors)
    tol = HALF_TOL[dtype]
    torch.testing.assert_close(torch.cat(outs, 2).double(), want, **tol)
    torch.testing.assert_close(torch.cat(step_outs, 2).double(), want, **tol)


def test_half_state_is_refused_for_another_dtype():
    """A state made by bfloat16 calls serves bfloat16 inputs only (never cast silently), though it holds float32."""
    attn = build("transformer-xl", torch.float32, mem_len=3)
    q, k, v = (t.detach() for t in _inputs(torch.bfloat16))
    _, st = attn(q, k, v, causal=True, return_state=True)
    with pytest.raises(attnkit.InvalidInputError, match="dtype"):
        attn(q.float(), k.float(), v.float(), causal=True, state=st)


@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_the_float32_path_runs(name, opts):
    """The mechanism sees float32 q, k, v for half inputs (a spy on ``_attend`` and ``_step_body``); float32 and
    float64 inputs pass through unchanged."""
    attn = build(name, torch.bfloat16, **opts)
    seen = []
    real_attend, real_step = attn._attend, attn._step_body
    attn._attend = lambda q, k, v, ctx: seen.append(q.dtype) or real_attend(q, k, v, ctx)
    attn._step_body = lambda q, k, v, st: seen.append(q.dtype) or real_step(q, k, v, st)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        seen.clear()
        q, k, v = (t.detach() for t in _inputs(dtype))
        assert attn(q, k, v, causal=True).dtype == dtype
        assert attn.step(q, k, v, attn.init_state(2, dtype=dtype))[0].dtype == dtype
        inner = torch.float32 if dtype in HALF else dtype
        assert seen == [inner, inner]


@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
def test_float16_scores_beyond_its_range(name, opts):
    """float16 inputs whose scores exceed float16's range (entries ~200: scaled scores up to ~1e5 > 65504): finite
    and close to the float64 reference (in float16 the scores overflow to inf)."""
    attn = build(name, torch.float32, **opts)
    g = torch.Generator().manual_seed(5)
    q, k = ((200 * torch.randn(2, 2, 7, 4, generator=g)).half() for _ in range(2))
    v = torch.randn(2, 2, 7, 4, generator=g).half()
    out = attn(q, k, v, causal=True)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    want, _, _ = _reference(attn, q, k, v)
    torch.testing.assert_close(out.double(), want, **HALF_TOL[torch.float16])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_gtrxl_block_in_half(dtype):
    """A ``gtrxl`` block cast with ``.to(dtype)`` on half inputs: output and input gradient in the input dtype,
    close to the float64 block with the same (rounded) weights; its transformer-xl memory stays float32."""
    torch.manual_seed(0)
    block = attnkit.build_block("gtrxl", dim=8, num_heads=2, attention="transformer-xl", mem_len=3).to(dtype)
    ref = copy.deepcopy(block).double()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    xh = x.to(dtype).requires_grad_()
    out, st = block(xh, causal=True, return_state=True)
    assert out.dtype == dtype
    floats = [t for t in st.data.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert floats and all(t.dtype == torch.float32 for t in floats)
    xr = xh.detach().double().requires_grad_()
    want = ref(xr, causal=True)
    tol = HALF_TOL[dtype]
    # the block's own layers (norms, gates, projections) run in the half dtype: twice the kit's tolerance
    torch.testing.assert_close(out.double(), want, atol=tol["atol"] * 2, rtol=tol["rtol"] * 2)
    (g,) = torch.autograd.grad(out.float().sum(), xh)
    (gw,) = torch.autograd.grad(want.sum(), xr)
    assert g.dtype == dtype
    torch.testing.assert_close(g.double(), gw, atol=tol["atol"] * 10, rtol=tol["rtol"] * 10)
