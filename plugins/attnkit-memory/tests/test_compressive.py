"""compressive beyond the kit: eviction in whole groups, bounds, the reconstruction loss's stop-gradients."""

from __future__ import annotations

import pytest
import torch
from attnkit_memory.compressive import naive
from memory_helpers import build, by_segments, qkv

import attnkit
from attnkit.errors import InvalidInputError

COMPRESSIONS = ("max", "mean", "conv", "most_used")


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_segments_equal_the_loop_reference(compression, chunk):
    attn = build("compressive", mem_len=3, cmem_len=4, compression_rate=3, compression=compression)
    q, k, v = qkv(N=23)
    out, st = by_segments(attn, q, k, v, chunk)
    torch.testing.assert_close(out, naive.segment_reference(attn, q, k, v, chunk), atol=1e-12, rtol=1e-10)
    assert 3 <= st.data["k"].shape[2] <= 3 + 3 - 1          # mem_len .. mem_len + c - 1
    assert st.data["ck"].shape[2] == 4                        # cmem_len slots after 23 positions


def test_compressed_memory_is_used():
    """Against transformer-xl with the same memory (same seed, same parameters): equal until slots exist, then not."""
    a = build("compressive", mem_len=2, cmem_len=4, compression_rate=2)
    b = build("transformer-xl", mem_len=2)
    q, k, v = qkv(N=12)
    oa, _ = by_segments(a, q, k, v, 4)
    ob, _ = by_segments(b, q, k, v, 4)
    assert torch.allclose(oa[:, :, :4], ob[:, :, :4])          # first segment: no memory yet, same module shape
    assert not torch.allclose(oa[:, :, 8:], ob[:, :, 8:])


def test_reconstruction_loss_trains_only_the_compression():
    attn = build("compressive", mem_len=2, cmem_len=4, compression_rate=2, compression="conv")
    q, k, v = qkv(N=8, grad=True)
    out, _ = by_segments(attn, q, k, v, 4)
    aux = attnkit.aux_losses(attn)
    assert set(aux) == {"attention_reconstruction"} and aux["attention_reconstruction"] > 0
    params = [q, k, v, attn.u, attn.v_bias, attn.r_proj.weight, attn.conv_k, attn.conv_v]
    grads = torch.autograd.grad(aux["attention_reconstruction"], params, allow_unused=True)
    assert all(g is None for g in grads[:6])                  # stop-gradient into the attention and memories
    assert grads[6].abs().max() > 0 and grads[7].abs().max() > 0
    task = torch.autograd.grad(out.sum(), [attn.conv_k, attn.conv_v], allow_unused=True)
    assert all(g is None or g.abs().max() == 0 for g in task)  # the task loss does not train f_c


def test_conv_compression_learns_to_reconstruct():
    torch.manual_seed(0)
    attn = build("compressive", mem_len=2, cmem_len=8, compression_rate=2, compression="conv")
    opt = torch.optim.Adam([attn.conv_k, attn.conv_v], lr=0.05)
    q, k, v = qkv(N=16, seed=3)
    losses = []
    for _ in range(30):
        by_segments(attn, q, k, v, 4)
        loss = attnkit.aux_losses(attn)["attention_reconstruction"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]


def test_step_records_no_aux_loss_and_no_grad_records_none():
    attn = build("compressive", mem_len=2, cmem_len=2, compression_rate=2)
    q, k, v = qkv(N=8)
    st = attn.init_state(2)
    for s in range(0, 8, 2):
        _, st = attn.step(q[:, :, s:s + 2], k[:, :, s:s + 2], v[:, :, s:s + 2], st)
    with torch.no_grad():
        by_segments(attn, q, k, v, 2)
    assert attnkit.aux_losses(attn) == {}


@pytest.mark.parametrize("opts,word", [({"compression_rate": 0}, "compression_rate"), ({"cmem_len": 0}, "cmem_len"),
                                       ({"mem_len": 0}, "mem_len"), ({"compression": "zip"}, "compression")])
def test_bad_options(opts, word):
    with pytest.raises(InvalidInputError, match=word):
        build("compressive", **opts)


def test_conv_refuses_other_value_dims():
    attn = build("compressive", mem_len=1, compression_rate=2, compression="conv")
    q, k, v = qkv(N=4, E=6)
    with pytest.raises(InvalidInputError, match="value_dim"):
        by_segments(attn, q, k, v, 2)


def test_padding_is_never_compressed_into_slots():
    attn = build("compressive", mem_len=1, cmem_len=4, compression_rate=2, compression="max")
    q, k, v = qkv(N=8)
    kpm = torch.ones(2, 4, dtype=torch.bool)
    kpm[:, 0] = False
    outs = []
    for fill in (0.0, 1e30, float("nan")):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 0] = v2[:, :, 0] = fill
        _, st = attn(q[:, :, :4], k2[:, :, :4], v2[:, :, :4], causal=True, key_padding_mask=kpm, return_state=True)
        o, _ = attn(q[:, :, 4:], k2[:, :, 4:], v2[:, :, 4:], causal=True, state=st, return_state=True)
        outs.append(o)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
