"""transformer-xl beyond the kit: the shift against the gather, memory gradients, padding in memory, bounds."""

from __future__ import annotations

import pytest
import torch
from attnkit_memory.common import rel_shift
from attnkit_memory.transformer_xl import naive
from memory_helpers import build, by_segments, qkv

import attnkit
from attnkit.errors import InvalidInputError, UnsupportedFeatureError


@pytest.mark.parametrize("L,T", [(1, 1), (3, 3), (3, 8), (5, 5), (4, 11)])
def test_rel_shift_is_the_index_gather_and_a_view(L, T):
    raw = torch.randn(2, 3, L, T)
    out = rel_shift(raw)
    assert out.data_ptr() >= raw.data_ptr() and out.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    i = torch.arange(L)[:, None]
    j = torch.arange(T)[None, :]
    d = (T - L) + i - j
    valid = d >= 0
    want = raw.gather(-1, (T - 1 - d).clamp(0, T - 1).expand(2, 3, L, T))
    assert torch.equal(out[..., valid], want[..., valid])


def test_shift_gradient_matches_gather_gradient():
    attn = build("transformer-xl", mem_len=3)
    q, k, v = qkv(N=7, grad=True)
    out = attn(q[:, :, 2:], k, v, causal=True)
    ref = naive.reference(attn, q[:, :, 2:], k, v)
    g = torch.randn_like(out)
    params = [q, k, v, attn.u, attn.v_bias, attn.r_proj.weight]
    a = torch.autograd.grad(out, params, g)
    b = torch.autograd.grad(ref, params, g)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_training_forward_equals_step_inference_in_a_model(chunk):
    """A two-block model: forward(state=..., return_state=True) segment by segment == Transformer.step."""
    torch.manual_seed(0)
    model = attnkit.Transformer(8, 2, 2, attention="transformer-xl", attention_options={"mem_len": 3}).double()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    outs, st = [], None
    for s in range(0, 10, chunk):
        o, st = model(x[:, s:s + chunk], causal=True, state=st, return_state=True)
        outs.append(o)
    trained = torch.cat(outs, 1)
    with torch.no_grad():
        st2, outs2 = model.init_state(2), []
        for s in range(0, 10, chunk):
            o, st2 = model.step(x[:, s:s + chunk], st2)
            outs2.append(o)
    torch.testing.assert_close(trained.detach(), torch.cat(outs2, 1), atol=1e-12, rtol=1e-10)


def test_memory_is_detached_by_default():
    attn = build("transformer-xl", mem_len=4)
    q, k, v = qkv(N=8, grad=True)
    out, _ = by_segments(attn, q, k, v, 4)
    gk, gv = torch.autograd.grad(out[:, :, 4:].sum(), [k, v])
    assert gk[:, :, :4].abs().max() == 0 and gv[:, :, :4].abs().max() == 0     # no gradient into segment 1
    assert gk[:, :, 4:].abs().max() > 0


@pytest.mark.parametrize("grad_segments", [1, 3])
def test_grad_segments_keeps_gradients_through_memory(grad_segments):
    attn = build("transformer-xl", mem_len=6, grad_segments=grad_segments)
    q, k, v = qkv(N=9, grad=True)
    out, _ = by_segments(attn, q, k, v, 3)
    ref = naive.segment_reference(attn, q, k, v, 3)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    g = torch.randn_like(out)
    if grad_segments >= 3:
        got = torch.autograd.grad(out, [q, k, v, attn.u], g)  # all in the graph
        want = torch.autograd.grad(ref, [q, k, v, attn.u], g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    else:  # one segment back: segment 3's output reaches segment 2's keys but not segment 1's
        gk = torch.autograd.grad(out[:, :, 6:].sum(), k)[0]
        assert gk[:, :, 3:6].abs().max() > 0 and gk[:, :, :3].abs().max() == 0


def test_padding_in_memory_has_no_influence():
    attn = build("transformer-xl", mem_len=5)
    q, k, v = qkv(N=8)
    kpm = torch.ones(2, 4, dtype=torch.bool)
    kpm[0, 1] = kpm[1, 3] = False
    outs = []
    for fill in (0.0, float("nan"), 1e30):
        k2, v2 = k.clone(), v.clone()
        k2[0, :, 1], v2[0, :, 1], k2[1, :, 3], v2[1, :, 3] = fill, fill, fill, fill
        _, st = attn(q[:, :, :4], k2[:, :, :4], v2[:, :, :4], causal=True, key_padding_mask=kpm, return_state=True)
        o, _ = attn(q[:, :, 4:], k2[:, :, 4:], v2[:, :, 4:], causal=True, state=st, return_state=True)
        assert torch.isfinite(o).all()
        outs.append(o)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    torch.testing.assert_close(outs[0], outs[2], atol=0, rtol=0)


def test_memory_stays_bounded():
    attn = build("transformer-xl", mem_len=5)
    q, k, v = qkv(N=40)
    _, st = by_segments(attn, q, k, v, 3)
    assert st.data["k"].shape[2] == 5 and st.position == 40


@pytest.mark.parametrize("opts,word", [({"mem_len": 0}, "mem_len"), ({"grad_segments": -1}, "grad_segments"),
                                       ({"rel_dim": 7}, "rel_dim"), ({"max_distance": 0}, "max_distance")])
def test_bad_options(opts, word):
    with pytest.raises(InvalidInputError, match=word):
        build("transformer-xl", **opts)


def test_heads_and_head_dim_required():
    with pytest.raises(InvalidInputError, match="num_heads and head_dim"):
        attnkit.build("transformer-xl")


def test_span_beyond_the_relative_table_is_refused_and_state_kept():
    attn = build("transformer-xl", mem_len=4, max_distance=6)
    q, k, v = qkv(N=8)
    with pytest.raises(UnsupportedFeatureError, match="max_length 6"):
        attn(q, k, v, causal=True)                      # a segment of 8 > 6 (the limits property)
    _, st = attn(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True, return_state=True)
    with pytest.raises(UnsupportedFeatureError, match="max_distance=6"):
        attn(q[:, :, 4:8], k[:, :, 4:8], v[:, :, 4:8], causal=True, state=st, return_state=True)  # 4 + 4 > 6
    assert st.position == 4 and st.data["k"].shape[2] == 4    # the state is neither reset nor truncated
    o, st2 = attn(q[:, :, 4:6], k[:, :, 4:6], v[:, :, 4:6], causal=True, state=st, return_state=True)
    assert st2.position == 6


def test_states_from_elsewhere_are_refused():
    attn = build("transformer-xl", mem_len=4)
    q, k, v = qkv(N=4)
    _, st = attn(q, k, v, causal=True, return_state=True)
    with pytest.raises(InvalidInputError, match="batch size"):
        attn(q[:1], k[:1], v[:1], causal=True, state=st)
    with pytest.raises(InvalidInputError, match="float64"):
        attn.float()(q.float(), k.float(), v.float(), causal=True, state=st)
    attn.double()
    other = build("transformer-xl", mem_len=5)
    with pytest.raises(InvalidInputError, match="configuration"):
        other(q, k, v, causal=True, state=st)
    comp = build("compressive", mem_len=4)
    with pytest.raises(InvalidInputError, match="belongs to 'transformer-xl'"):
        comp(q, k, v, causal=True, state=st)
    _, _, v6 = qkv(N=4, E=6)
    with pytest.raises(InvalidInputError, match="E=4"):
        attn.step(q, k, v6, st)


def test_noncausal_is_refused():
    attn = build("transformer-xl")
    q, k, v = qkv(N=4)
    with pytest.raises(UnsupportedFeatureError, match="causal"):
        attn(q, k, v)


def test_a_detached_memory_holds_no_graph():
    """Default grad_segments=0: the returned memory has no autograd history (a later backward cannot reach it)."""
    attn = build("transformer-xl", mem_len=3)
    q, k, v = qkv(N=6, grad=True)
    out, st = by_segments(attn, q, k, v, 3)
    assert st.data["k"].grad_fn is None and not st.data["k"].requires_grad
    out.sum().backward()
    o2, _ = attn(q[:, :, :3].detach(), k[:, :, :3].detach(), v[:, :, :3].detach(), causal=True, state=st,
                 return_state=True)
    o2.sum().backward()      # would fail with "backward through the graph a second time" if st held the graph


def test_relative_table_cache_follows_the_weights():
    attn = build("transformer-xl", mem_len=3)
    q, k, v = qkv(N=5)
    with torch.no_grad():
        a = attn(q, k, v, causal=True)
        attn.r_proj.weight.mul_(2.0)                 # an in-place update (an optimiser step) invalidates it
        b = attn(q, k, v, causal=True)
    torch.testing.assert_close(b, naive.reference(attn, q, k, v).detach(), atol=1e-12, rtol=1e-10)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("name,opts", [("transformer-xl", {"mem_len": 5}),
                                       ("compressive", {"mem_len": 2, "cmem_len": 2, "compression_rate": 2})])
def test_sdpa_path_equals_torch_path_with_memory_padding_and_gradients(name, opts):
    fast, slow = build(name, backend="sdpa", **opts), build(name, backend="torch", **opts)
    q, k, v = qkv(N=9, grad=True)
    kpm = torch.ones(2, 3, dtype=torch.bool)
    kpm[1] = False                                            # batch 1's first segment entirely padded
    outs = []
    for attn in (fast, slow):
        st, parts = None, []
        for s in range(0, 9, 3):
            o, st = attn(q[:, :, s:s + 3], k[:, :, s:s + 3], v[:, :, s:s + 3], causal=True, state=st,
                         return_state=True, key_padding_mask=kpm if s == 0 else None)
            parts.append(o)
        outs.append(torch.cat(parts, 2))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=1e-10)
    assert outs[0][1, :, :3].abs().max() == 0                # rows that see no key give 0, not NaN
    g = torch.randn_like(outs[0])
    ga = torch.autograd.grad(outs[0], [q, k, v, fast.u, fast.v_bias, fast.r_proj.weight], g)
    gb = torch.autograd.grad(outs[1], [q, k, v, slow.u, slow.v_bias, slow.r_proj.weight], g)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
