"""``fast-weight``: the naive reference (the delta rule as a per-step loop) against every backend, and the
delta-rule operators against each other (torch chunk, numba, the step form), outputs and gradients, float64."""

from __future__ import annotations

import pytest
import torch
from comparisons import DTYPES, against_reference, agree, backends, build, close, padding, rand

from attnkit_kernelized._ops import backend_module
from attnkit_kernelized.fast_weight import chunk, recurrent
from attnkit_kernelized.linear import chunk as linear_chunk

OPTIONS = [{}, {"feature_map": "elu", "beta": 0.7, "normalize": False, "scale": 0.5},
           {"feature_map": "dpfp", "dpfp_nu": 2}]
BACKENDS = backends("torch", "numba")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("L", [1, 13, 21])
@pytest.mark.parametrize("pad", [False, True])
def test_module_matches_naive_reference(backend, opts, L, pad):
    against_reference("fast-weight", opts, backend, causal=True, L=L, S=L, kpm=padding(2, L) if pad and L > 2 else None,
                      segment=8)


def _delta_inputs(L, dtype, M=6, E=3):
    q = rand((2, 2, L, M), 0, dtype, positive=True)
    k0 = torch.rand(2, 2, L, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    k = (k0 / k0.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    v = rand((2, 2, L, E), 2, dtype)
    beta = torch.rand(2, 2, L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    S0 = rand((2, 2, M, E), 4, dtype)
    return q, k, v, beta.to(dtype).requires_grad_(), S0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,block", [(1, 4), (9, 4), (37, 16)])
def test_numba_operator_matches_torch_chunk(dtype, L, block):
    ins = _delta_inputs(L, dtype)
    want = chunk.delta_rule(*ins, chunk=5)
    got = backend_module("fast_weight", "numba").delta_rule(*ins, chunk=block)
    agree(got, want, ins, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_form_matches_the_step_form(dtype):
    ins = _delta_inputs(11, dtype)
    for a, b in zip(chunk.delta_rule(*ins, chunk=4), recurrent.delta_rule_step(*ins)):
        close(a, b, dtype)


def test_numba_gradcheck():
    q, k, v, beta, S0 = _delta_inputs(7, torch.float64, M=3, E=2)
    numba_ops = backend_module("fast_weight", "numba")
    assert torch.autograd.gradcheck(lambda *a: numba_ops.delta_rule(*a, chunk=3), (q, k, v, beta, S0))


def test_delta_rule_replaces_instead_of_adding():
    """Writing a new value under the same key with beta = 1 overwrites it (the 'remove' of the delta
    rule); the additive (linear) memory would return the sum."""
    key = torch.tensor([1.0, 0.0, 0.0])
    other = torch.tensor([0.0, 1.0, 0.0])
    k = torch.stack([key, other, key])[None, None]                 # (1, 1, 3, 3)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 7.0]])[None, None]
    q = torch.stack([key, key, key])[None, None]
    beta = torch.ones(1, 1, 3)
    for ops in (chunk, backend_module("fast_weight", "numba")):
        out, _ = ops.delta_rule(q, k, v, beta, chunk=2)
        torch.testing.assert_close(out[0, 0, 2], torch.tensor([5.0, 7.0]))   # latest value, not [6, 7]
        torch.testing.assert_close(out[0, 0, 0], torch.tensor([1.0, 0.0]))
    num, _, _, _ = linear_chunk.linear_num_den(q, k, v, causal=True, chunk=2)
    torch.testing.assert_close(num[0, 0, 2], torch.tensor([6.0, 7.0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_equals_causal_forward(backend):
    attn = build("fast-weight", backend=backend, chunk_size=4)
    q, k, v = (rand((2, 2, 15, 4), s, torch.float64) for s in (1, 2, 3))
    full = attn(q, k, v, causal=True)
    state, outs = attn.init_state(2, dtype=torch.float64), []
    for t0, t1 in ((0, 4), (4, 5), (5, 15)):
        o, state = attn.step(q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1], state)
        outs.append(o)
    close(torch.cat(outs, 2), full, torch.float64)
    o1, st = attn(q[:, :, :6], k[:, :, :6], v[:, :, :6], causal=True, return_state=True)
    o2, st2 = attn(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], causal=True, state=st, return_state=True)
    close(torch.cat([o1, o2], 2), full, torch.float64)
    assert set(st2.data) == {"S"} and st2.data["S"].shape == (2, 2, 8, 4)
