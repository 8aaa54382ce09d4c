"""The triton operators of gated causal ``rfa`` and of ``fast-weight`` (the delta rule) against the chunked torch
forms: outputs, final states and gradients (inputs, gates / write strengths and the carried state), float32 and
float64, lengths not multiples of the chunk, several blocks of value columns, half-precision inputs with float32
states, and the custom operators' registration (``torch.library.opcheck``).

Module-level agreement with each spec's reference (options, padding masks, streaming, garbage at padded keys)
runs the ``triton`` backend through the parametrised tests of ``test_rfa.py``, ``test_fast_weight.py`` and
``test_hardening.py``. Every test here carries the ``triton`` mark: it runs under ``TRITON_INTERPRET=1`` on CPU
tensors (the noxfile's ``kernels`` session), tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from comparisons import DTYPES, TRITON, agree, build, grads, rand

from attnkit_kernelized.fast_weight import chunk as delta_chunk
from attnkit_kernelized.rfa import chunk as gated_chunk

pytestmark = TRITON


def _gated_ops():
    from attnkit_kernelized.rfa import triton_ops

    return triton_ops


def _delta_ops():
    from attnkit_kernelized.fast_weight import triton_ops

    return triton_ops


def _gated_inputs(L, dtype, M=6, E=3, B=2, H=2):
    q, k = rand((B, H, L, M), 0, dtype, positive=True), rand((B, H, L, M), 1, dtype, positive=True)
    v = rand((B, H, L, E), 2, dtype)
    g = torch.rand(B, H, L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    log_g = torch.log(0.05 + 0.95 * g).to(dtype).requires_grad_()
    S0, z0 = rand((B, H, M, E), 4, dtype, positive=True), rand((B, H, M), 5, dtype, positive=True)
    return q, k, v, log_g, S0, z0


def _delta_inputs(L, dtype, M=6, E=3, B=2, H=2):
    q = rand((B, H, L, M), 0, dtype, positive=True)
    k0 = torch.rand(B, H, L, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    k = (k0 / k0.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    v = rand((B, H, L, E), 2, dtype)
    beta = torch.rand(B, H, L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    S0 = rand((B, H, M, E), 4, dtype)
    return q, k, v, beta.to(dtype).requires_grad_(), S0


# ------------------------------------------------------------------ against the chunked torch forms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,block", [(1, 4), (13, 4), (37, 16)])
def test_gated_operator_matches_torch_chunk(dtype, L, block):
    """Blocks of 16 positions (block 4 rounds up): 37 = 2 full blocks + 5; the torch form in chunks of 5."""
    ins = _gated_inputs(L, dtype)
    agree(_gated_ops().gated_attention(*ins, chunk=block), gated_chunk.gated_attention(*ins, chunk=5), ins, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,block", [(1, 4), (13, 4), (37, 16)])
def test_delta_operator_matches_torch_chunk(dtype, L, block):
    ins = _delta_inputs(L, dtype)
    agree(_delta_ops().delta_rule(*ins, chunk=block), delta_chunk.delta_rule(*ins, chunk=5), ins, dtype)


def test_gated_operator_without_a_carried_state_and_with_no_decay():
    """S0 = z0 = None (zeros) and log g = 0 (ungated RFA runs this kernel too): plain causal linear attention."""
    q, k, v, log_g, _, _ = _gated_inputs(21, torch.float64)
    zero = torch.zeros_like(log_g).requires_grad_()
    ins = (q, k, v, zero)
    agree(_gated_ops().gated_attention(*ins, chunk=16), gated_chunk.gated_attention(*ins, chunk=8), ins,
          torch.float64)


def test_several_blocks_of_value_columns():
    """E + 1 = 65 (rfa) and E = 65 (delta) columns: two programs per sequence; the delta rule's backward sums the
    partial gradients of q, k and beta over them."""
    ins = _gated_inputs(7, torch.float64, M=5, E=64, B=1)
    agree(_gated_ops().gated_attention(*ins, chunk=16), gated_chunk.gated_attention(*ins, chunk=4), ins,
          torch.float64)
    ins = _delta_inputs(7, torch.float64, M=5, E=65, B=1)
    agree(_delta_ops().delta_rule(*ins, chunk=16), delta_chunk.delta_rule(*ins, chunk=4), ins, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_many_chunks_and_blocks_of_features(dtype):
    """The chunk-parallel gated kernels: 6 chunks of 16 positions, the last one partial (the scan carries the
    state across all of them), 70 features (two blocks of 64 in the output kernel, three of 32 in the scan) and
    E + 1 = 67 value columns (several blocks), forward and backward (the reversed kernels) against the torch
    form."""
    ins = _gated_inputs(85, dtype, M=70, E=66, B=1, H=1)
    agree(_gated_ops().gated_attention(*ins, chunk=16), gated_chunk.gated_attention(*ins, chunk=7), ins, dtype)


def test_gradient_of_a_state_only_loss():
    """A loss on the final state alone (the streaming case: a state carried into the next call): the gradients
    of every input the state depends on (all but the queries), S0 and z0 included, agree with the torch forms."""
    ins = _gated_inputs(19, torch.float64)
    got, want = _gated_ops().gated_attention(*ins, chunk=16), gated_chunk.gated_attention(*ins, chunk=5)
    for a, b in zip(grads(got[1:], ins[1:]), grads(want[1:], ins[1:]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8)
    ins = _delta_inputs(19, torch.float64)
    got, want = _delta_ops().delta_rule(*ins, chunk=16), delta_chunk.delta_rule(*ins, chunk=5)
    for a, b in zip(grads(got[1:], ins[1:]), grads(want[1:], ins[1:]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8)


def test_streaming_through_the_operators():
    """Two calls carrying the state equal one call over the whole sequence (lengths 11 + 14, block 16)."""
    q, k, v, log_g, S0, z0 = (t.detach() for t in _gated_inputs(25, torch.float64))
    ops = _gated_ops()
    full, S, z = ops.gated_attention(q, k, v, log_g, S0, z0, chunk=16)
    a, Sa, za = ops.gated_attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], log_g[:, :, :11], S0, z0, chunk=16)
    b, Sb, zb = ops.gated_attention(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], log_g[:, :, 11:], Sa, za, chunk=16)
    for x, y in ((torch.cat([a, b], 2), full), (Sb, S), (zb, z)):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)
    q, k, v, beta, S0 = (t.detach() for t in _delta_inputs(25, torch.float64))
    ops = _delta_ops()
    full, S = ops.delta_rule(q, k, v, beta, S0, chunk=16)
    a, Sa = ops.delta_rule(q[:, :, :11], k[:, :, :11], v[:, :, :11], beta[:, :, :11], S0, chunk=16)
    b, Sb = ops.delta_rule(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], beta[:, :, 11:], Sa, chunk=16)
    torch.testing.assert_close(torch.cat([a, b], 2), full, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(Sb, S, atol=1e-12, rtol=1e-10)


def test_gradcheck():
    """Numerical gradients of both operators (float64, 2 blocks of 16 positions; fast mode: random projections,
    the full Jacobian takes a minute in the interpreter)."""
    q, k, v, log_g, S0, z0 = _gated_inputs(18, torch.float64, M=3, E=2, B=1, H=1)
    ops = _gated_ops()
    assert torch.autograd.gradcheck(lambda *a: ops.gated_attention(*a, chunk=16), (q, k, v, log_g, S0, z0),
                                    fast_mode=True)
    q, k, v, beta, S0 = _delta_inputs(18, torch.float64, M=3, E=2, B=1, H=1)
    S0.requires_grad_()
    ops = _delta_ops()
    assert torch.autograd.gradcheck(lambda *a: ops.delta_rule(*a, chunk=16), (q, k, v, beta, S0), fast_mode=True)


# ------------------------------------------------------------------ half precision: float32 states
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gated_half_inputs_accumulate_in_float32(dtype):
    """Ungated, 64 keys with features ~20 and values ~100: the state sums ~1.3e5 per entry, past float16's
    largest finite value (65504). The state is float32 and finite, and the output (in the input dtype) agrees with
    float64 on the same rounded inputs; so do the gradients."""
    L, M, E = 64, 4, 3
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(1, 2, L, M, generator=g, dtype=torch.float64) * 20).to(dtype).requires_grad_()
    k = (torch.rand(1, 2, L, M, generator=g, dtype=torch.float64) * 20 + 10).to(dtype).requires_grad_()
    v = (torch.rand(1, 2, L, E, generator=g, dtype=torch.float64) * 100 + 50).to(dtype).requires_grad_()
    log_g = torch.zeros(1, 2, L, dtype=dtype, requires_grad=True)
    out, S, z = _gated_ops().gated_attention(q, k, v, log_g, chunk=16)
    assert out.dtype == dtype and S.dtype == torch.float32 and z.dtype == torch.float32
    assert S.abs().max() > 65504 and torch.isfinite(S).all() and torch.isfinite(out).all()
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, log_g)]
    want, S64, z64 = gated_chunk.gated_attention(*ins64, chunk=16)
    torch.testing.assert_close(S.double(), S64, atol=0, rtol=1e-5)
    torch.testing.assert_close(out.double(), want, atol=0, rtol=1e-2)     # the output's own rounding
    g_got = grads([out.float()], [q, k, v])
    g_want = grads([want], ins64[:3])
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=1e-2 * b.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_delta_half_inputs_accumulate_in_float32(dtype):
    """The delta rule on half inputs: a float32 state equal to float64 on the same rounded inputs to float32
    accuracy (a float16 state would round every one of the 40 updates to 3 digits), the output and the
    gradients to the output's own rounding."""
    ins = [t.detach().to(dtype).requires_grad_() for t in _delta_inputs(40, torch.float64, M=8, E=4, B=1)]
    out, S = _delta_ops().delta_rule(*ins, chunk=16)
    assert out.dtype == dtype and S.dtype == torch.float32
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    want, S64 = delta_chunk.delta_rule(*ins64, chunk=16)
    torch.testing.assert_close(S.double(), S64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)
    for a, b in zip(grads([out.float(), S], ins), grads([want, S64], ins64), strict=True):
        assert a.dtype == dtype and torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=3e-2 * b.abs().max().item(), rtol=3e-2)


# ------------------------------------------------------------------ the operators themselves
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_custom_operators_pass_opcheck():
    """Schema, fake (meta) functions, autograd registration and tracing with dynamic shapes (what
    ``torch.compile`` needs) of the differentiable operators."""
    _gated_ops()  # registers the operators
    q, k, v, log_g, S0, z0 = _gated_inputs(5, torch.float64, M=3, E=2, B=1)
    torch.library.opcheck(torch.ops.attnkit_kernelized.triton_gated_attention.default,
                          (q, k, v, log_g, S0.detach().requires_grad_(), z0.detach().requires_grad_(), 16),
                          test_utils=CHECKS)
    q, k, v, beta, S0 = _delta_inputs(5, torch.float64, M=3, E=2, B=1)
    _delta_ops()
    torch.library.opcheck(torch.ops.attnkit_kernelized.triton_delta_rule.default,
                          (q, k, v, beta, S0.requires_grad_(), 16),
                          test_utils=CHECKS)


def _ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("attnkit_kernelized::")}


def test_the_modules_run_the_triton_operators_forward_and_backward():
    q, k, v = (rand((1, 2, 7, 4 if i < 2 else 3), i, torch.float64) for i in range(3))
    rfa = build("rfa", backend="triton", num_features=4)
    ran = _ops_run(lambda: rfa(q, k, v, causal=True).sum().backward())
    assert {"attnkit_kernelized::triton_gated_attention", "attnkit_kernelized::triton_gated_product"} <= ran, ran
    fw = build("fast-weight", backend="triton")
    ran = _ops_run(lambda: fw(q, k, v, causal=True).sum().backward())
    assert {"attnkit_kernelized::triton_delta_rule", "attnkit_kernelized::triton_delta_backward"} <= ran, ran


def test_context_parallel_on_the_triton_backend():
    """The sequence split across 2 gloo ranks (uneven chunks, NaN/Inf at padded keys and values): outputs and
    gradients equal one process's, on the triton kernels (rfa: gated summaries with the chunk's total decay;
    fast-weight: the chunk's affine map of the state, run through the kernels with an identity state)."""
    from attnkit.testing.context_parallel import check_context_parallel

    H, D = 2, 8
    cases = [("rfa", {"num_features": 8, "seed": 1, "num_heads": H, "head_dim": D, "backend": "triton"}),
             ("fast-weight", {"num_heads": H, "head_dim": D, "backend": "triton"})]
    failures = check_context_parallel(cases, worlds=[2], lengths=[5, 6], shape=(2, H, D, D))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name,opts", [("rfa", {"num_features": 8}), ("fast-weight", {})], ids=str)
def test_compile_fullgraph_matches_eager(name, opts):
    """torch.compile(fullgraph=True) of a small transformer on the triton backend (a multi-head layer: transposed
    q, k, v; a padding mask): no graph break, the same outputs and gradients as eager. ``aot_eager``: dynamo and
    the operators' fake functions and registered backward, without inductor's C++ build."""
    import attnkit

    torch.manual_seed(0)
    model = attnkit.Transformer(16, 1, 2, name, attention_options={"backend": "triton", **opts}).double().eval()
    x = rand((2, 9, 16), 0, torch.float64)
    kpm = torch.ones(2, 9, dtype=torch.bool)
    kpm[1, :2] = False
    eager = model(x, causal=True, key_padding_mask=kpm)
    g_eager = torch.autograd.grad(eager.square().mean(), [x, *model.parameters()])
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x, causal=True, key_padding_mask=kpm)
    g = torch.autograd.grad(out.square().mean(), [x, *model.parameters()])
    torch.testing.assert_close(out, eager, atol=1e-12, rtol=1e-10)
    for a, b in zip(g, g_eager, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
