"""memory-tokens beyond the kit: information carried by the slots, truncated backpropagation, bad input."""

from __future__ import annotations

import pytest
import torch
from attnkit_memory.memory_tokens import naive
from memory_helpers import build, by_segments, qkv

from attnkit.errors import InvalidInputError


def test_slots_carry_the_previous_segment():
    attn = build("memory-tokens", num_memory=2)
    q, k, v = qkv(N=8)
    out, _ = by_segments(attn, q, k, v, 4)
    k2 = k.clone()
    k2[:, :, 1] += 1.0                                            # change segment 1 only
    out2, _ = by_segments(attn, q, k2, v, 4)
    assert not torch.allclose(out[:, :, 4:], out2[:, :, 4:])     # segment 2 reads it through the slots
    fresh = attn(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], causal=True)
    assert not torch.allclose(out[:, :, 4:], fresh)


@pytest.mark.parametrize("grad_segments,from2,from3", [(0, [False, True], [False, False, True]),
                                                       (1, [True, True], [False, False, True]),
                                                       (2, [True, True], [True, True, True])])
def test_truncated_backpropagation_through_the_slots(grad_segments, from2, from3):
    """Which segments' keys a loss on segment 2 / 3 reaches: blocks of grad_segments + 1 segments."""
    attn = build("memory-tokens", num_memory=2, grad_segments=grad_segments)
    q, k, v = qkv(N=9, grad=True)
    out, _ = by_segments(attn, q, k, v, 3)
    torch.testing.assert_close(out, naive.segment_reference(attn, q, k, v, 3), atol=1e-12, rtol=1e-10)
    g2 = torch.autograd.grad(out[:, :, 3:6].sum(), k, retain_graph=True)[0]
    g3 = torch.autograd.grad(out[:, :, 6:].sum(), k)[0]
    assert [bool(g2[:, :, s:s + 3].abs().max() > 0) for s in (0, 3)] == from2
    assert [bool(g3[:, :, s:s + 3].abs().max() > 0) for s in (0, 3, 6)] == from3


def test_initial_slots_are_trained():
    attn = build("memory-tokens", num_memory=2)
    q, k, v = qkv(N=4)
    out = attn(q, k, v, causal=True)
    g = torch.autograd.grad(out.sum(), attn.mem_k)[0]
    assert g.abs().max() > 0


@pytest.mark.parametrize("opts,word", [({"num_memory": 0}, "num_memory"), ({"grad_segments": -1}, "grad_segments")])
def test_bad_options(opts, word):
    with pytest.raises(InvalidInputError, match=word):
        build("memory-tokens", **opts)


def test_other_value_dims_and_states_are_refused():
    attn = build("memory-tokens", num_memory=2)
    q, k, v = qkv(N=4)
    _, st = attn(q, k, v, causal=True, return_state=True)
    _, _, v6 = qkv(N=4, E=6)
    with pytest.raises(InvalidInputError, match="E=4"):
        attn(q, k, v6, causal=True, state=st)
    other = build("memory-tokens", num_memory=3)
    with pytest.raises(InvalidInputError, match="configuration"):
        other(q, k, v, causal=True, state=st)
    with pytest.raises(InvalidInputError, match="batch size"):
        attn.step(q[:1], k[:1], v[:1], st)
    assert st.position == 4
