"""``linear``: the naive reference against every backend (module level), and the backends' operators
against each other (torch chunk, numba, triton, the step form), outputs and gradients, float64, odd lengths."""

from __future__ import annotations

import pytest
import torch
from comparisons import DTYPES, against_reference, agree, backends, build, close, grads, padding, rand

from attnkit_kernelized import feature_maps
from attnkit_kernelized._ops import backend_module
from attnkit_kernelized.linear import chunk, recurrent

OPTIONS = [{}, {"feature_map": "relu"}, {"feature_map": "softplus", "scale": 0.5},
           {"feature_map": "dpfp", "dpfp_nu": 2}]
BACKENDS = backends("torch", "numba", "triton")


# ------------------------------------------------------------------ module vs the naive reference
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("causal,L,S", [(True, 21, 21), (False, 13, 13), (False, 7, 11), (False, 11, 5)])
@pytest.mark.parametrize("pad", [False, True])
def test_module_matches_naive_reference(backend, opts, causal, L, S, pad):
    against_reference("linear", opts, backend, causal=causal, L=L, S=S, kpm=padding(2, S) if pad else None)


@pytest.mark.parametrize("name", ["linear", "performer", "rfa", "fast-weight"])
def test_segment_length_follows_the_device(name):
    """Causal calls segment by ``segment_length`` on the CPU and by ``cuda_segment_length`` on CUDA (65,536:
    short segments leave a GPU idle); linear never segments; an instance may lower either (long calls' memory)."""
    attn = build(name, **({"num_features": 8} if name in ("performer", "rfa") else {}))
    cpu, cuda = attn.segment_length_for(torch.device("cpu")), attn.segment_length_for(torch.device("cuda"))
    if name == "linear":
        assert cpu == cuda == 1 << 62
    else:
        assert (cpu, cuda) == (2048, 65536)
    attn.cuda_segment_length = 4096
    assert attn.segment_length_for(torch.device("cuda", 0)) == 4096
    assert attn.segment_length_for(torch.device("cpu")) == cpu


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,opts", [("linear", {}), ("performer", {"num_features": 12})])
def test_segments_carry_the_state(backend, name, opts):
    """A causal call in segments of 5 positions (features of one segment at a time, the state carried
    across them) equals the reference, with autograd and without (the first segment and a bit of the
    second see no key at all in batch 0: zeros)."""
    against_reference(name, opts, backend, causal=True, L=23, S=23, kpm=padding(2, 23), segment=5)
    attn = build(name, backend=backend, chunk_size=4, **opts)
    attn.segment_length = 5
    q, k, v = (rand((2, 2, 23, 4), s, torch.float64).detach() for s in (5, 6, 7))
    kpm = torch.ones(2, 23, dtype=torch.bool)
    kpm[0, :7] = False
    with torch.no_grad():
        got = attn(q, k, v, causal=True, key_padding_mask=kpm)
    want = build(name, backend="torch", **opts)(q, k, v, causal=True, key_padding_mask=kpm)
    close(got, want, torch.float64)
    assert (got[0, :, :7] == 0).all()


# ------------------------------------------------------------------ the backends' operators
def _ops_inputs(L, S, dtype, M=5, E=3):
    q, k = rand((2, 3, L, M), 0, dtype, positive=True), rand((2, 3, S, M), 1, dtype, positive=True)
    v = rand((2, 3, S, E), 2, dtype)
    S0, z0 = rand((2, 3, M, E), 3, dtype, positive=True), rand((2, 3, M), 4, dtype, positive=True)
    return q, k, v, S0, z0


@pytest.mark.parametrize("backend", backends("numba", "triton"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,L,S,block", [(True, 1, 1, 4), (True, 7, 7, 3), (True, 37, 37, 16),
                                              (True, 64, 64, 32), (False, 5, 9, 4), (False, 33, 3, 16)])
def test_kernel_operator_matches_torch_chunk(backend, dtype, causal, L, S, block):
    """Outputs, final state and every gradient (with a state carried in) agree with the torch form."""
    ins = _ops_inputs(L, S, dtype)
    want = chunk.linear_attention(*ins, causal=causal, chunk=5)
    got = backend_module("linear", backend).linear_attention(*ins, causal=causal, chunk=block)
    agree(got, want, ins, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_form_matches_the_step_form(dtype):
    """The chunked causal form from a state equals the per-position recurrence (step) from it."""
    q, k, v, S0, z0 = _ops_inputs(13, 13, dtype)
    out, S, z = chunk.linear_attention(q, k, v, S0, z0, causal=True, chunk=4)
    o2, S2, z2 = recurrent.linear_attention_step(q, k, v, S0, z0)
    close(out, o2, dtype)
    close(S, S2, dtype)
    close(z, z2, dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_numba_gradcheck(causal):
    q, k = rand((1, 2, 7, 3), 0, torch.float64, positive=True), rand((1, 2, 7, 3), 1, torch.float64, positive=True)
    v = rand((1, 2, 7, 2), 2, torch.float64)
    S0, z0 = rand((1, 2, 3, 2), 3, torch.float64, positive=True), rand((1, 2, 3), 4, torch.float64, positive=True)
    numba_ops = backend_module("linear", "numba")
    assert torch.autograd.gradcheck(
        lambda *a: numba_ops.linear_attention(*a, causal=causal, chunk=3), (q, k, v, S0, z0))


# ------------------------------------------------------------------ streaming and options
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_with_state_equals_one_call(backend):
    """forward(state=..., return_state=True) in uneven pieces equals one causal call; gradients flow through
    the state (segment-by-segment training)."""
    attn = build("linear", backend=backend, chunk_size=4)
    q, k, v = (rand((2, 2, 17, 4), s, torch.float64) for s in (1, 2, 3))
    full = attn(q, k, v, causal=True)
    state, outs, start = None, [], 0
    for size in (5, 1, 11):
        sl = slice(start, start + size)
        o, state = attn(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=True, state=state, return_state=True)
        outs.append(o)
        start += size
    joined = torch.cat(outs, 2)
    close(joined, full, torch.float64)
    for a, b in zip(grads([joined], [q, k, v]), grads([full], [q, k, v])):
        close(a, b, torch.float64, 10)
    assert state.position == 17 and state.data["S"].shape == (2, 2, 4, 4)


def test_step_equals_causal_forward_and_the_state_is_sized_by_the_values():
    attn = build("linear", feature_map="dpfp")
    q, k = rand((2, 2, 9, 4), 1, torch.float64), rand((2, 2, 9, 4), 2, torch.float64)
    v = rand((2, 2, 9, 6), 3, torch.float64)                    # E = 6 != D = 4
    state = attn.init_state(2, dtype=torch.float64)
    outs = []
    for t in range(0, 9, 2):
        o, state = attn.step(q[:, :, t:t + 2], k[:, :, t:t + 2], v[:, :, t:t + 2], state)
        outs.append(o)
    close(torch.cat(outs, 2), attn(q, k, v, causal=True), torch.float64)
    assert state.data["S"].shape == (2, 2, 8, 6) and state.data["z"].shape == (2, 2, 8)   # M = 2·D


def test_feature_maps():
    x = torch.tensor([[1.0, -2.0, 0.5]])
    assert torch.all(feature_maps.elu_feature_map(torch.randn(100)) > 0)
    phi = feature_maps.dpfp_feature_map(x, nu=2)
    assert phi.shape == (1, 12)
    r = torch.tensor([[1.0, 0.0, 0.5, 0.0, 2.0, 0.0]])
    torch.testing.assert_close(phi[:, :6], r * torch.roll(r, 1, -1))
    torch.testing.assert_close(phi[:, 6:], r * torch.roll(r, 2, -1))
    assert feature_maps.feature_dim("dpfp", 3, nu=2) == 12 and feature_maps.feature_dim("elu", 3) == 3


@pytest.mark.parametrize("D,nu", [(1, 1), (3, 1), (3, 2), (3, 3), (2, 5), (8, 3)])
def test_dpfp_slices_equal_the_rolled_definition(D, nu):
    """The DPFP map takes each roll as a slice of one extended relu (nu <= D) or rolls as written (nu > D):
    bit-identical values and the same gradients as ``r * roll(r, i)``."""
    x = torch.randn(2, 3, 5, D, dtype=torch.float64, requires_grad=True)
    r = torch.relu(torch.cat([x, -x], dim=-1))
    want = torch.cat([r * torch.roll(r, shifts=i, dims=-1) for i in range(1, nu + 1)], dim=-1)
    got = feature_maps.dpfp_feature_map(x, nu=nu)
    assert torch.equal(got, want)
    w = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad((got * w).sum(), x)[0], torch.autograd.grad((want * w).sum(), x)[0])


def test_the_module_uses_the_feature_maps_module():
    """One copy of the feature maps: the module's phi is the one in feature_maps (scale folded in first)."""
    attn = build("linear", feature_map="softplus", scale=0.25)
    q, k = torch.randn(1, 2, 5, 4, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
    phi_q, phi_k = attn.feature_pair(q, k, causal=False)
    torch.testing.assert_close(phi_q, feature_maps.softplus_feature_map(q * 0.5))
    torch.testing.assert_close(phi_k, feature_maps.softplus_feature_map(k * 0.5))
