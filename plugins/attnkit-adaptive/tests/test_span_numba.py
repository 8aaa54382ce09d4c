"""The span mechanisms' numba kernels against the plain reference (float64) and the torch band path (float32).

Outputs and gradients of q, k, v and of the span parameters; odd lengths, spans across query blocks and key
tiles, integer spans (the ramp's gradient at its bound), key padding holding NaN/Inf, rows with no key.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.masks import causal, key_padding
from attnkit_adaptive.span.naive import reference

pytest.importorskip("numba")

from attnkit_adaptive.span.numba_band import span_band_attention_numba  # noqa: E402


def _grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), tensors, allow_unused=True, retain_graph=True)


def _span(spans, *, max_span=16, ramp=2.5, block_size=4, backend="numba", dtype=torch.float64):
    attn = attnkit.build("adaptive-span", num_heads=len(spans), max_span=max_span, ramp=ramp, block_size=block_size,
                         backend=backend).to(dtype)
    with torch.no_grad():
        attn.span_fraction.copy_(torch.tensor(spans, dtype=dtype) / max_span)
    return attn


def _poisoned(t, kpm, value):
    """``t`` with ``value`` written at the padded keys (the attention must not see them)."""
    return t.detach().masked_fill(~kpm[:, None, :, None], value).requires_grad_()


def _check_poisoned_against_reference(attn, qkv, L):
    """``attn`` (causal, key padding with NaN / Inf in the padded keys / values) against the dense float64
    reference: outputs and the gradients of q, k, v and the spans (finite, equal); returns those gradients."""
    q, k, v = qkv(L, H=3, grad=True)
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, 3:9] = False
    kpm[0, 0] = False
    kp, vp = _poisoned(k, kpm, float("nan")), _poisoned(v, kpm, float("inf"))
    out = attn(q, kp, vp, causal=True, key_padding_mask=kpm)
    ref = reference(attn, q, k, v, mask=causal() & key_padding(kpm))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    got = _grads(out, (q, kp, vp, attn.span_fraction))
    want = _grads(ref, (q, k, v, attn.span_fraction))
    for name, a, b in zip("q k v span".split(), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9, msg=lambda m, n=name: f"grad {n}: {m}")
    return got


def test_auto_backend_is_numba_on_cpu(qkv):
    attn = attnkit.build("adaptive-span", num_heads=2, max_span=16)
    q, _, _ = qkv(5)
    assert attn.resolve_backend(q) == "numba"
    assert attnkit.build("dynamic-span", num_heads=2, head_dim=8).resolve_backend(q) == "numba"


@pytest.mark.parametrize("block_size", [3, 8, 64])
@pytest.mark.parametrize(("L", "spans"), [(21, [0.0, 2.5, 5.3]), (37, [11.7, 13.2, 0.4]), (33, [3.0, 7.0, 16.0])])
def test_numba_equals_reference_float64_with_poisoned_padding(qkv, block_size, L, spans):
    """Outputs and gradients (q, k, v, spans) equal the dense reference; padded keys hold NaN / Inf; the spans
    cross query blocks; integer spans put pairs exactly on the ramp's upper bound (num == R)."""
    ramp = 2.0 if spans[0] == 3.0 else 2.5
    attn = _span(spans, ramp=ramp, block_size=block_size)
    got = _check_poisoned_against_reference(attn, qkv, L)
    assert got[3].abs().min() > 0  # every head's span learns


def test_rows_with_no_key_are_zero_with_finite_gradients(qkv):
    """Span 0.4 + ramp 1: a query reaches itself and one key back; both padded -> the row is 0, not NaN."""
    L = 12
    attn = _span([0.4, 0.4], ramp=1.0, block_size=4)
    q, k, v = qkv(L, grad=True)
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[0, 4:8] = False
    out = attn(q, _poisoned(k, kpm, float("nan")), _poisoned(v, kpm, float("-inf")), causal=True,
               key_padding_mask=kpm)
    assert (out[0, :, 5:8] == 0).all()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(attn, q, k, v, mask=causal() & key_padding(kpm)), atol=1e-12,
                               rtol=1e-10)
    for g in _grads(out, (q, attn.span_fraction)):
        assert torch.isfinite(g).all()


def test_span_zero_with_a_short_ramp_reads_only_the_diagonal(qkv):
    """z = 0, R = 0.5: m(0) = 1, m(1) = 0, so each query returns its own value."""
    attn = _span([0.0, 0.0], ramp=0.5, block_size=4)
    q, k, v = qkv(9, E=8)
    torch.testing.assert_close(attn(q, k, v, causal=True), v, atol=1e-15, rtol=0)


def test_spans_across_key_tiles(qkv):
    """L = 300 with spans of 150 and 40: the 128-key tiles of the kernels are crossed; float64 vs reference."""
    attn = _span([150.0, 40.3], max_span=256, ramp=16.0, block_size=64)
    q, k, v = qkv(300, B=1, D=4, E=3, grad=True)
    out = attn(q, k, v, causal=True)
    ref = reference(attn, q, k, v, mask=causal())
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    params = (q, k, v, attn.span_fraction)
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("L", [1, 7, 45])
def test_float32_numba_matches_the_torch_band_path(qkv, L):
    """float32: the numba kernels and the torch band path agree (outputs and every gradient), with padding."""
    kw = dict(max_span=32, ramp=3.0, block_size=8, dtype=torch.float32)
    fast, slow = _span([4.5, 19.0], backend="numba", **kw), _span([4.5, 19.0], backend="torch", **kw)
    q, k, v = qkv(L, dtype=torch.float32, grad=True)
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, L // 2:] = False
    a = fast(q, k, v, causal=True, key_padding_mask=kpm)
    b = slow(q, k, v, causal=True, key_padding_mask=kpm)
    torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    for x, y in zip(_grads(a, (q, k, v, fast.span_fraction)), _grads(b, (q, k, v, slow.span_fraction))):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)


def test_dynamic_span_numba_equals_reference_with_per_query_reach(qkv):
    """Per-query spans from 0 to the maximum: each query reads its own reach; predictor gradients agree."""
    L = 41
    attn = attnkit.build("dynamic-span", num_heads=2, head_dim=8, max_span=20, ramp=2.0, init_span=5.0,
                         block_size=8, backend="numba").double()
    with torch.no_grad():
        attn.span_weight.normal_(0, 1.5)
    q, k, v = qkv(L, grad=True)
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[0, 10:14] = False
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    ref = reference(attn, q, k, v, mask=causal() & key_padding(kpm))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    z = attn.spans_for(q).detach()
    assert float(z.min()) < 1.0 and float(z.max()) > 15.0  # the spans really range widely
    params = (q, k, v, attn.span_weight, attn.span_bias)
    for a, b in zip(_grads(out, params), _grads(ref, params)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_direct_function_per_query_and_per_head_spans_give_span_gradients_of_their_shape(qkv):
    q, k, v = qkv(10, grad=True)
    for z in (torch.full((1, 2, 1), 3.5, dtype=torch.float64, requires_grad=True),
              torch.rand(2, 2, 10, dtype=torch.float64).mul(6).requires_grad_()):
        out = span_band_attention_numba(q, k, v, z, 1.5, scale=0.4, block_size=4)
        (gz,) = torch.autograd.grad(out.sum() * 0 + (out ** 2).sum(), (z,))
        assert gz.shape == z.shape and torch.isfinite(gz).all() and gz.abs().sum() > 0


def test_direct_function_refuses_other_dtypes(qkv):
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        span_band_attention_numba(q.half(), k.half(), v.half(), torch.ones(1, 2, 1), 1.0, scale=1.0)
    with pytest.raises(ValueError, match="one dtype"):
        span_band_attention_numba(q, k.float(), v, torch.ones(1, 2, 1), 1.0, scale=1.0)


def _spy(monkeypatch):
    """Record each kernel launch of the numba backend: ``[(kernel name, args), ...]``."""
    from attnkit_adaptive.span import numba_band

    calls = []
    run = numba_band._run

    def spy(kernel, items, *args):
        calls.append((kernel.py_func.__name__, args))
        return run(kernel, items, *args)

    monkeypatch.setattr(numba_band, "_run", spy)
    return calls


@pytest.mark.parametrize("saved", [True, False])
@pytest.mark.parametrize(("chunks", "bwd_block"), [(None, None), (3, None), (2, 5), (50, 3)])
def test_fused_backward_equals_reference(qkv, monkeypatch, saved, chunks, bwd_block):
    """The fused query-major backward against the float64 reference: scores kept by the forward or recomputed;
    one chunk of query blocks per row or several (keys before a chunk go through its spill rows, spill windows
    longer than a chunk included: 50 chunks of 3-row blocks under spans of 13); a backward block other than the
    forward's; spans across blocks, odd length, poisoned padding, a row with no key."""
    from attnkit_adaptive.span import numba_band

    monkeypatch.setattr(numba_band, "FUSED_CHUNKS", chunks)
    monkeypatch.setattr(numba_band, "FUSED_BLOCK", bwd_block)
    if not saved:
        monkeypatch.setattr(numba_band, "SCORES_MAX_BYTES", 0)
    calls = _spy(monkeypatch)
    _check_poisoned_against_reference(_span([11.7, 13.2, 0.4], ramp=2.5, block_size=4), qkv, 37)
    names = [c[0] for c in calls]
    assert names[0] == "forward" and names[1] == "backward_fused"
    # the forward kept the scores (its `save`), the backward read them (its `have_s`)
    assert calls[0][1][-4] is saved and calls[1][1][-8] is saved
    if chunks:
        assert "add_spill" in names, names


def test_fused_backward_head_size_64_and_per_query_spans(qkv, monkeypatch):
    """D = E = 64 (the products' constant-width copy) and D = 64, E = 24; per-query spans (dynamic-span) with
    spill chunks; float64 against the reference."""
    from attnkit_adaptive.span import numba_band

    monkeypatch.setattr(numba_band, "FUSED_CHUNKS", 3)
    for E in (64, 24):
        L = 70
        q, k, v = qkv(L, B=1, D=64, E=E, grad=True, seed=E)
        z = torch.rand(1, 2, L, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).mul(40)
        z.requires_grad_()
        out = span_band_attention_numba(q, k, v, z, 3.0, scale=0.125, block_size=8)
        ref = _dense_span(q, k, v, z, 3.0, 0.125)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
        for a, b in zip(_grads(out, (q, k, v, z)), _grads(ref, (q, k, v, z))):
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def _dense_span(q, k, v, z, ramp, scale):
    """The soft-span attention written out densely (per-query spans ``z (B, H, L)``): the plain reference's route."""
    L = q.shape[-2]
    i = torch.arange(L, dtype=q.dtype)
    x = i[:, None] - i[None, :]
    m = ((ramp + z[..., None] - x) / ramp).clamp(0, 1) * (x >= 0)
    s = torch.exp(q @ k.transpose(-1, -2) * scale - (q @ k.transpose(-1, -2) * scale).amax(-1, keepdim=True))
    w = m * s
    return (w / w.sum(-1, keepdim=True)) @ v


def test_forward_keeps_no_scores_without_a_gradient(qkv, monkeypatch):
    calls = _spy(monkeypatch)
    q, k, v = qkv(20, grad=True)
    z = torch.full((1, 2, 1), 4.0, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        span_band_attention_numba(q, k, v, z, 2.0, scale=0.3, block_size=4)
    span_band_attention_numba(q.detach(), k.detach(), v.detach(), z.detach(), 2.0, scale=0.3, block_size=4)
    span_band_attention_numba(q, k, v, z, 2.0, scale=0.3, block_size=4)
    assert [c[1][-4] for c in calls] == [False, False, True]  # the forward's `save`
