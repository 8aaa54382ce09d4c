"""``fast-weight``: the naive reference (the delta rule as a per-step loop) against every backend, and the
delta-rule operators against each other (torch chunk, numba, the step form), outputs and gradients, float64."""

from __future__ import annotations

import pytest
import torch
from comparisons import DTYPES, against_reference, agree, backends, build, close, grads, padding, rand

from attnkit_kernelized._ops import backend_module
from attnkit_kernelized.fast_weight import chunk, recurrent
from attnkit_kernelized.linear import chunk as linear_chunk

OPTIONS = [{}, {"feature_map": "elu", "beta": 0.7, "normalize": False, "scale": 0.5},
           {"feature_map": "dpfp", "dpfp_nu": 2}]
BACKENDS = backends("torch", "numba", "triton")


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
@pytest.mark.parametrize("L,block,M,E", [(1, 4, 6, 3), (9, 4, 6, 3), (37, 16, 6, 3), (100, 64, 20, 19),
                                         (70, 24, 33, 17)])
def test_numba_operator_matches_torch_chunk(dtype, L, block, M, E):
    """The chunked forward in blocks of at most ``BLOCK`` positions that never cross a checkpoint (``block``: the
    checkpoint interval), and the backward recomputing from those checkpoints; widths that are not multiples of
    the vector width."""
    ins = _delta_inputs(L, dtype, M=M, E=E)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,block", [(1, 4), (7, 4), (13, 4), (23, 8), (37, 16), (9, 64)])
def test_ut_chunk_form_matches_the_step_form_with_gradients(dtype, L, block):
    """The chunked UT-transform form against the per-position recurrence from the same S0: outputs, final
    state and the gradients of q, k, v, beta and S0 (lengths not multiples of the chunk)."""
    ins = _delta_inputs(L, dtype)
    ins[-1].requires_grad_()
    agree(chunk.delta_rule(*ins, chunk=block), recurrent.delta_rule_step(*ins), ins, dtype)


def test_ut_chunk_form_gradcheck():
    q, k, v, beta, S0 = _delta_inputs(7, torch.float64, M=3, E=2)
    S0.requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: chunk.delta_rule(*a, chunk=3), (q, k, v, beta, S0))


def test_ut_chunk_form_zero_key_writes_nothing():
    """A zero key row (a padded key) leaves the state and every other output as if it were absent."""
    q, k, v, beta, S0 = (x.detach() for x in _delta_inputs(9, torch.float64))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4] = 0.0
    v2[:, :, 4] = 123.0
    out, S = chunk.delta_rule(q, k2, v2, beta, S0, chunk=4)
    keep = [t for t in range(9) if t != 4]
    want, S_want = recurrent.delta_rule_step(q[:, :, keep], k[:, :, keep], v[:, :, keep], beta[:, :, keep], S0)
    close(out[:, :, keep], want, torch.float64)
    close(S, S_want, torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), 1e30])
def test_padded_keys_have_no_influence(backend, junk):
    """Whatever padded keys and values hold, outputs and the gradients of q, k, v (zero at padded keys) and of
    the beta parameters equal those with zeros there; nothing is NaN."""
    attn = build("fast-weight", backend=backend, chunk_size=4)
    L = 11
    kpm = padding(2, L)
    q, k, v = (rand((2, 2, L, 4), s, torch.float64) for s in (1, 2, 3))
    k_junk, v_junk = (x.detach().clone() for x in (k, v))
    pad = ~kpm[:, None, :, None]
    k_junk = k_junk.masked_fill(pad, junk).requires_grad_()
    v_junk = v_junk.masked_fill(pad, junk).requires_grad_()
    params = [p for p in attn.parameters() if p.requires_grad]
    clean = attn(q, k, v, causal=True, key_padding_mask=kpm)
    dirty = attn(q, k_junk, v_junk, causal=True, key_padding_mask=kpm)
    assert torch.isfinite(dirty).all()
    close(dirty, clean, torch.float64)
    g_clean = grads([clean], [q, *params])
    *g_dirty, gk, gv = grads([dirty], [q, *params, k_junk, v_junk])
    for a, b in zip(g_dirty, g_clean, strict=True):
        close(a, b, torch.float64)
    assert torch.isfinite(gk).all() and torch.isfinite(gv).all()
    assert not gk.masked_select(pad.expand_as(gk)).any() and not gv.masked_select(pad.expand_as(gv)).any()
