"""MultiHeadAttention and the pre-norm Transformer stack."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import InvalidInputError, MultiHeadAttention, Transformer


def test_mha_matches_torch_multihead_attention():
    torch.manual_seed(0)
    dim, H = 16, 4
    ours = MultiHeadAttention(dim, H)
    ref = torch.nn.MultiheadAttention(dim, H, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(2, 7, dim)
    pad = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    ours_out = ours(x, key_padding_mask=pad)
    ref_out, _ = ref(x, x, x, key_padding_mask=~pad)  # torch's True means "ignore"
    torch.testing.assert_close(ours_out, ref_out, atol=1e-5, rtol=1e-5)


def test_mha_cross_attention_and_causal_masks():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2)
    x, ctx = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    assert mha(x, ctx).shape == (2, 3, 8)
    y = mha(x, causal=True)
    x2 = x.clone()
    x2[:, -1] += 10.0  # change only the future
    torch.testing.assert_close(mha(x2, causal=True)[:, :-1], y[:, :-1])


def test_mha_streaming_matches_causal_forward():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 6, 8)
    state = mha.init_state(2)
    outs = []
    for t in range(6):
        o, state = mha.step(x[:, t:t + 1], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), mha(x, causal=True), atol=1e-6, rtol=1e-5)


def test_transformer_stack_shapes_streaming_and_grad():
    torch.manual_seed(0)
    model = Transformer(16, depth=2, num_heads=4)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = model(x, causal=True)
    assert y.shape == (2, 5, 16)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    state = model.init_state(2)
    outs = []
    for t in range(5):
        o, state = model.step(x[:, t:t + 1].detach(), state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), y.detach(), atol=1e-5, rtol=1e-5)


def test_mha_accepts_a_built_module_and_options():
    attn = attnkit.build("softmax", dropout=0.1)
    assert MultiHeadAttention(8, 2, attn).attention is attn
    assert MultiHeadAttention(8, 2, "softmax", dropout=0.0).attention.dropout == 0.0
    with pytest.raises(InvalidInputError, match="already built attention module"):
        MultiHeadAttention(8, 2, attn, scale=0.5)


@pytest.mark.parametrize("kw, pattern", [
    (dict(dim=10, num_heads=3), "dim: expected a multiple of num_heads=3, got 10"),
    (dict(dim=0, num_heads=1), "dim: expected a positive int"),
    (dict(dim=8, num_heads=2, attention=42), "attention: expected a registered name"),
])
def test_mha_bad_arguments(kw, pattern):
    with pytest.raises(InvalidInputError, match=pattern):
        MultiHeadAttention(**kw)


def test_mha_bad_input_shape():
    with pytest.raises(InvalidInputError, match=r"x: expected a \(B, L, dim=8\) tensor, got shape \(2, 3, 4\)"):
        MultiHeadAttention(8, 2)(torch.randn(2, 3, 4))


def test_transformer_bad_depth_and_unknown_attention():
    with pytest.raises(InvalidInputError, match="depth: expected a positive int"):
        Transformer(8, 0, 2)
    with pytest.raises(attnkit.UnknownAttentionError, match="did you mean 'softmax'"):
        Transformer(8, 1, 2, attention="softmaks")


def test_attention_only_blocks_with_mlp_ratio_zero():
    model = Transformer(8, depth=2, num_heads=2, mlp_ratio=0)
    assert all(b.mlp is None for b in model.blocks)
    assert not any("mlp" in n for n, _ in model.named_parameters())
    x = torch.randn(2, 5, 8)
    y = model(x, causal=True)
    state = model.init_state(2)
    outs = []
    for t in range(5):
        o, state = model.step(x[:, t:t + 1], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), y, atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidInputError, match=r"mlp_ratio: expected a number >= 0"):
        Transformer(8, 1, 2, mlp_ratio=-1)
