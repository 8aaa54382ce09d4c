"""Exact streaming of the causal forms of local, dilated, strided and fixed, with states that keep only what
later queries can still see."""

from __future__ import annotations

import pytest
import torch

import attnkit

CASES = [("local", {"window": 4}), ("dilated", {"window": 3, "dilation": 2}), ("strided", {"stride": 3}),
         ("fixed", {"stride": 4, "c": 1})]


@pytest.mark.parametrize("name,options", CASES)
@pytest.mark.parametrize("chunk", [1, 5])
def test_streaming_equals_the_causal_forward(qkv, name, options, chunk):
    attn = attnkit.build(name, backend="torch", **options)
    q, k, v = qkv(23)
    full = attn(q, k, v, causal=True)
    state, outs = attn.init_state(2, dtype=q.dtype), []
    for s in range(0, 23, chunk):
        o, state = attn.step(q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name,options,bound", [
    ("local", {"window": 4}, lambda t: 3),                     # the window - 1 previous keys
    ("dilated", {"window": 3, "dilation": 2}, lambda t: 4),    # (window - 1) · dilation
    ("fixed", {"stride": 4, "c": 1}, lambda t: t // 4 + 4),    # c per finished block + the current block
])
def test_state_keeps_only_what_later_queries_can_see(name, options, bound):
    attn = attnkit.build(name, backend="torch", **options)
    state = attn.init_state(1, dtype=torch.float64)
    x = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    sizes = []
    for t in range(1, 121):
        _, state = attn.step(x, x, x, state)
        sizes.append(attn.state_size(state))
        assert sizes[-1] <= bound(t), f"{name}: {sizes[-1]} keys held after {t} positions"
    if name != "fixed":
        assert max(sizes) == bound(120)  # bounded by the window, not by the 120 positions seen


def test_strided_state_is_the_whole_cache():
    """Every earlier key stays visible to some later query through the stride column, so none can be dropped."""
    attn = attnkit.build("strided", stride=3, backend="torch")
    state = attn.init_state(1, dtype=torch.float64)
    x = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    for _ in range(10):
        _, state = attn.step(x, x, x, state)
    assert attn.state_size(state) == 20


def test_a_state_does_not_cross_to_another_window(qkv):
    q, k, v = qkv(4)
    a, b = attnkit.build("local", window=4), attnkit.build("local", window=5)
    _, state = a(q, k, v, causal=True, return_state=True)
    with pytest.raises(attnkit.InvalidInputError, match="another configuration"):
        b.step(q, k, v, state)


def test_forward_with_state_refuses_extra_masks(qkv):
    q, k, v = qkv(4)
    attn = attnkit.build("local", window=4)
    with pytest.raises(attnkit.InvalidInputError, match="takes causal=True only"):
        attn(q, k, v, causal=True, key_padding_mask=torch.ones(2, 4, dtype=torch.bool), return_state=True)


def test_patterns_without_streaming_refuse_it(qkv):
    q, k, v = qkv(4)
    with pytest.raises(attnkit.UnsupportedFeatureError):
        attnkit.build("bigbird").init_state(2)
