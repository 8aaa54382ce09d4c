"""adaptive-span and dynamic-span: the band path against the dense soft-mask reference, limits, penalty, cost."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.masks import causal, key_padding
from attnkit_adaptive.span.band import band_blocks, span_band_attention
from attnkit_adaptive.span.naive import reference, soft_span_mask


def _build(name="adaptive-span", **kw):
    return attnkit.build(name, **kw).double()


def _grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), tensors, allow_unused=True, retain_graph=True)


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("block_size", [3, 4, 8, 64])
@pytest.mark.parametrize("spans", [[0.0, 2.5], [5.3, 11.7], [13.2, 0.4]])
def test_band_equals_dense_reference_outputs_and_grads(qkv, block_size, spans, backend):
    """float64, spans crossing block boundaries: outputs and gradients of q, k, v and of the spans agree."""
    if backend == "numba":
        pytest.importorskip("numba")
    L = 21
    attn = _build(num_heads=2, max_span=16, ramp=2.5, block_size=block_size, backend=backend)
    with torch.no_grad():
        attn.span_fraction.copy_(torch.tensor(spans, dtype=torch.float64) / 16)
    q, k, v = qkv(L, grad=True)
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, 3:6] = False
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    ref = reference(attn, q, k, v, mask=causal() & key_padding(kpm))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    params = (q, k, v, attn.span_fraction)
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    assert _grads(out, params)[3].abs().sum() > 0  # the spans do learn


@pytest.mark.parametrize("L", [13, 21, 30])
def test_ragged_last_block_with_tiny_spans_has_finite_grads(qkv, L):
    """Padded query rows of the last block (L not a multiple of the block) never make an empty softmax row."""
    attn = _build(num_heads=2, max_span=16, ramp=1.5, init_span=0.0, block_size=8)
    q, k, v = qkv(L, grad=True)
    out = attn(q, k, v, causal=True)
    ref = reference(attn, q, k, v, mask=causal())
    params = (q, k, v, attn.span_fraction)
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_dynamic_span_band_equals_reference_incl_predictor_grads(qkv, backend):
    if backend == "numba":
        pytest.importorskip("numba")
    L = 19
    attn = _build("dynamic-span", num_heads=2, head_dim=8, max_span=12, ramp=2.0, init_span=4.0, block_size=4,
                  backend=backend)
    with torch.no_grad():
        attn.span_weight.normal_(0, 0.7)
    q, k, v = qkv(L, grad=True)
    out = attn(q, k, v, causal=True)
    ref = reference(attn, q, k, v, mask=causal())
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    z = attn.spans_for(q)
    assert float(z.detach().max() - z.detach().min()) > 1.0  # spans really differ per token
    params = (q, k, v, attn.span_weight, attn.span_bias)
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_full_span_and_vanishing_ramp_equal_causal_softmax(qkv):
    """span >= L and R -> 0: every causal key has m = 1, so adaptive-span is causal softmax."""
    L = 17
    attn = _build(num_heads=2, max_span=L, ramp=1e-9, init_span=L, block_size=4)
    q, k, v = qkv(L)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attn(q, k, v, causal=True), want, atol=1e-12, rtol=1e-10)


def test_soft_mask_formula():
    m = soft_span_mask(torch.tensor([[[3.0]]], dtype=torch.float64), 2.0, 8, 8)[0, 0, 7]
    # distances 7..0 for keys 0..7: clamp((2 + 3 - x) / 2, 0, 1), future keys none here
    want = torch.tensor([max(0.0, min(1.0, (5 - x) / 2)) for x in range(7, -1, -1)], dtype=torch.float64)
    torch.testing.assert_close(m, want)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_keys_beyond_the_band_are_never_read(qkv, backend):
    """Keys further back than the largest span + ramp, rounded up to a block, never reach the output (even NaN)."""
    if backend == "numba":
        pytest.importorskip("numba")
    L, C = 40, 4
    attn = _build(num_heads=2, max_span=32, ramp=2.0, init_span=3.0, block_size=C, backend=backend)
    q, k, v = qkv(L)
    nb = band_blocks(3.0, 2.0, C, L // C)
    assert nb == 1  # distances < 5 need one block back
    # the last query block [36, 40) reads keys [32, 40) only
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :32] = float("nan")
    v2[:, :, :32] = float("nan")
    out = attn(q, k2, v2, causal=True)
    assert torch.isfinite(out[:, :, 36:]).all()
    torch.testing.assert_close(out[:, :, 36:], attn(q, k, v, causal=True)[:, :, 36:])


def test_band_width_follows_the_span():
    assert band_blocks(64.0, 32.0, 64, 128) == 2           # distances < 96: 2 blocks back
    assert band_blocks(0.0, 32.0, 64, 128) == 1
    assert band_blocks(8192.0, 32.0, 64, 128) == 127      # capped at the sequence
    assert band_blocks(0.0, 1.0, 64, 128) == 0            # only the diagonal: own block


def test_span_penalty_recorded_and_trains_spans_down(qkv):
    attn = _build(num_heads=2, max_span=16, ramp=2.0, init_span=8.0, block_size=4)
    q, k, v = qkv(10)
    attn(q, k, v, causal=True)
    aux = attnkit.aux_losses(attn)
    torch.testing.assert_close(aux["span_l1"], torch.tensor(2e-6 * 8.0, dtype=torch.float64))
    attn(q, k, v, causal=True)
    loss = attnkit.aux_losses(attn, weighted=False)["span_l1"]
    loss.backward()
    assert (attn.span_fraction.grad > 0).all()  # gradient descent shrinks the spans
    assert attnkit.aux_losses(attn) == {}        # collected and cleared
    torch.testing.assert_close(attn.spans, torch.tensor([8.0, 8.0], dtype=torch.float64))


def test_float32_band_matches_float64_reference(qkv):
    attn = attnkit.build("adaptive-span", num_heads=2, max_span=16, ramp=3.0, init_span=6.0, block_size=4)
    q, k, v = qkv(23, dtype=torch.float32)
    out = attn(q, k, v, causal=True)
    ref = reference(attn.double(), q.double(), k.double(), v.double(), mask=causal())
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.siblings
def test_engine_window_agrees_with_hard_span():
    """Cross-check with the sparse engine: an integer span z and R -> 0 is a hard causal window of z + 1 keys."""
    pytest.importorskip("attnkit_sparse")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    z = 6
    span = _build(num_heads=2, max_span=16, ramp=1e-9, init_span=float(z), block_size=8)
    local = attnkit.build("local", window=z + 1)
    torch.testing.assert_close(span(q, k, v, causal=True), local(q, k, v, causal=True), atol=1e-12, rtol=1e-10)


def test_direct_band_function_with_per_query_spans(qkv):
    q, k, v = qkv(13, B=1, H=1)
    z = torch.linspace(0, 9, 13, dtype=torch.float64).view(1, 1, 13)

    class A:
        ramp = 1.5

        def get_scale(self, q):
            return 0.3

        def spans_for(self, q):
            return z

    out = span_band_attention(q, k, v, z, 1.5, scale=0.3, block_size=5)
    torch.testing.assert_close(out, reference(A(), q, k, v, mask=causal()), atol=1e-12, rtol=1e-10)


def test_span_pushed_out_of_range_is_projected_back_and_learns_again(qkv):
    """An optimizer step below 0 must not kill the span (the clamp would pass no gradient there)."""
    attn = _build(num_heads=2, max_span=16, ramp=2.0, init_span=4.0, block_size=4)
    with torch.no_grad():
        attn.span_fraction.copy_(torch.tensor([-0.3, 1.4], dtype=torch.float64))
    q, k, v = qkv(12, grad=True)
    out = attn(q, k, v, causal=True)
    torch.testing.assert_close(attn.span_fraction.detach(), torch.tensor([0.0, 1.0], dtype=torch.float64))
    (out * torch.randn_like(out)).sum().backward()
    assert attn.span_fraction.grad[0] != 0  # at the bound the gradient flows again


def test_repeated_forwards_in_one_graph_backpropagate(qkv):
    attn = _build(num_heads=2, max_span=16, ramp=2.0, init_span=4.0, block_size=4)
    q, k, v = qkv(12, E=8, grad=True)
    out = attn(attn(q, k, v, causal=True), k, v, causal=True)
    out.sum().backward()
    assert attn.span_fraction.grad is not None
