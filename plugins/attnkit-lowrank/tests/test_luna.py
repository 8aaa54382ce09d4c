"""``luna`` beyond the kit (float64): the state it returns, the state carried into the next layer, the causal
form's chunking and its last row.

The kit (tests/test_conformance.py) holds outputs and gradients to the plain
reference, non-causal and causal, with key padding, and runs causality.
"""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank.luna.naive import reference, reference_state

import attnkit

F64 = torch.float64


def _qkv(B=2, H=2, L=11, S=11, D=8, E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=F64), torch.randn(B, H, S, D, generator=g, dtype=F64),
            torch.randn(B, H, S, E, generator=g, dtype=F64))


def _build(**kw):
    torch.manual_seed(0)
    return attnkit.build("luna", head_dim=8, num_heads=2, **kw).double()


@pytest.mark.parametrize("causal", [False, True])
def test_returned_state_is_layernorm_of_p_plus_the_pack(causal):
    q, k, v = _qkv()
    attn = _build(packed_len=5)
    out, state = attn(q, k, v, causal=causal, return_state=True)
    assert isinstance(state, attnkit.AttentionState)
    torch.testing.assert_close(out, attn(q, k, v, causal=causal), atol=0, rtol=0)
    torch.testing.assert_close(state.data, reference_state(attn, q, k, v), atol=1e-12, rtol=1e-10)


def test_state_carries_into_the_next_layer_with_gradients():
    q, k, v = _qkv(seed=1)
    q2, k2, v2 = (t.requires_grad_(True) for t in _qkv(seed=2))
    layer1 = _build(packed_len=4)
    layer2 = _build(packed_len=4)
    _, s1 = layer1(q, k, v, return_state=True)
    out2 = layer2(q2, k2, v2, state=s1)
    # by hand: P = s1 packs layer 2's keys, its queries unpack
    p = s1.data
    scale = 8 ** -0.5
    a = torch.softmax(scale * p @ k2.transpose(-1, -2), -1)
    ref = torch.softmax(scale * q2 @ (a @ k2).transpose(-1, -2), -1) @ (a @ v2)
    torch.testing.assert_close(out2, ref, atol=1e-12, rtol=1e-10)
    _, s2 = layer2(q2, k2, v2, state=s1, return_state=True)
    torch.testing.assert_close(s2.data, reference_state(layer2, q2, k2, v2, packed=p), atol=1e-12, rtol=1e-10)
    # the learned P of layer 1 gets a gradient through layer 2's output
    w = torch.randn_like(out2)
    (g,) = torch.autograd.grad((layer2(q2, k2, v2, state=layer1(q, k, v, return_state=True)[1]) * w).sum(),
                               (layer1.packed,))
    assert g.abs().max() > 0
    assert layer2(q2, k2, v2).sub(out2).abs().max() > 1e-6      # the state changed the output


def test_causal_chunking_does_not_change_the_result_and_the_last_row_is_non_causal():
    q, k, v = _qkv(L=13, S=13)
    outs = [_build(packed_len=3, chunk_size=c, causal_form="prefix-softmax")(q, k, v, causal=True)
            for c in (1, 4, 64)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(outs[0], outs[2], atol=1e-12, rtol=1e-10)
    full = _build(packed_len=3)(q, k, v)
    torch.testing.assert_close(outs[0][:, :, -1], full[:, :, -1], atol=1e-12, rtol=1e-10)
    assert (outs[0][:, :, :-1] - full[:, :, :-1]).abs().max() > 1e-3


@pytest.mark.parametrize("form", ["paper", "prefix-softmax"])
def test_causal_with_extreme_scores_stays_finite_and_matches_reference(form):
    q, k, v = _qkv(L=10, S=10)
    attn = _build(packed_len=3, chunk_size=3, causal_form=form)
    k = k * 200.0                                    # pack scores spread over hundreds: exp under/overflows
    kpm = torch.ones(2, 10, dtype=torch.bool)
    kpm[0, :3] = False
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    assert torch.isfinite(out).all()
    assert out[0, :, :3].abs().max() == 0            # rows that see no real key
    ref = reference(attn, q, k, v, mask=attnkit.masks.causal() & attnkit.masks.key_padding(kpm))
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-7)


def test_paper_causal_form_by_hand_and_by_chunks():
    """The paper's causal Luna: K_p(t) = mean_{j<=t} (elu(scale P k_j) + 1) k_j, likewise V_p; softmax unpack."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(L=13, S=13))
    attn = _build(packed_len=3)
    assert attn.causal_form == "paper"                  # the default
    out = attn(q, k, v, causal=True)
    scale = 8 ** -0.5
    w = torch.nn.functional.elu(scale * attn.packed[0] @ k.transpose(-1, -2)) + 1      # (B, H, m, L)
    t = torch.arange(1, 14, dtype=F64)
    kp = torch.cumsum(w[..., None] * k[:, :, None], 3) / t[:, None]                    # (B, H, m, L, D)
    vp = torch.cumsum(w[..., None] * v[:, :, None], 3) / t[:, None]
    a = torch.softmax(scale * torch.einsum("bhtd,bhmtd->bhtm", q, kp), -1)
    want = torch.einsum("bhtm,bhmte->bhte", a, vp)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    for c in (1, 5):
        torch.testing.assert_close(_build(packed_len=3, chunk_size=c)(q, k, v, causal=True), out,
                                   atol=1e-12, rtol=1e-10)
    # and it differs from the prefix-softmax form (it is another causal attention, not a re-computation)
    other = _build(packed_len=3, causal_form="prefix-softmax")(q, k, v, causal=True)
    assert (other - out).abs().max() > 1e-3
    # gradients against the reference; position 4 depends on no later key
    ref = reference(attn, q, k, v, mask=attnkit.masks.causal())
    g = torch.randn_like(out)
    for x, y in zip(torch.autograd.grad((out * g).sum(), (q, k, v), retain_graph=True),
                    torch.autograd.grad((ref * g).sum(), (q, k, v))):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)
    gk, gv = torch.autograd.grad(out[:, :, 4].sum(), (k, v))
    assert gk[:, :, 5:].abs().max() == 0 and gv[:, :, 5:].abs().max() == 0


def test_options_are_checked():
    with pytest.raises(attnkit.InvalidInputError, match="causal_form"):
        attnkit.build("luna", head_dim=8, causal_form="softmax")
    with pytest.raises(attnkit.InvalidInputError, match="head_dim"):
        attnkit.build("luna")
    with pytest.raises(attnkit.InvalidInputError, match="packed_len"):
        attnkit.build("luna", head_dim=8, packed_len=0)
    with pytest.raises(attnkit.InvalidInputError, match="num_heads"):
        attnkit.build("luna", head_dim=8, per_head=True)
