"""``linear``'s fused causal forward (linear/numba_fused.py: ``elu(x) + 1`` and the product in one kernel, no
autograd) against the plain torch expressions and the unfused paths, in float64 (float32 within rounding).

Padded keys hold NaN/Inf and must not reach a value; rows with a zero denominator give 0; lengths are not
multiples of the block; a state is carried in and out.
"""

from __future__ import annotations

import pytest
import torch
from comparisons import elu_linear_causal

import attnkit
from attnkit_kernelized.common import padded
from attnkit_kernelized.linear.numba_fused import fused_causal


def _inputs(dtype, L, pad_tail=5, with_state=True):
    g = torch.Generator().manual_seed(1)
    B, H, D, E = 2, 3, 8, 5
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=dtype) * 2 for _ in range(2))
    v = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, L - pad_tail:] = False
    S0 = torch.rand(B, H, D, E, generator=g, dtype=dtype) if with_state else torch.zeros(B, H, D, E, dtype=dtype)
    z0 = torch.rand(B, H, D, generator=g, dtype=dtype) + 0.5 if with_state else torch.zeros(B, H, D, dtype=dtype)
    return q, k, v, kpm, S0, z0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L,chunk", [(1, 32), (37, 32), (70, 16), (64, 64), (45, 4), (100, 7)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.6])
def test_the_fused_kernel_equals_the_torch_expressions(dtype, L, chunk, with_state, scale):
    q, k, v, kpm, S0, z0 = _inputs(dtype, L, pad_tail=min(5, L), with_state=with_state)
    pad = padded(kpm)
    # padded keys hold anything (the module zeroes v there): they must not reach a value
    k_bad = k.clone()
    k_bad[1, :, L - 1] = float("nan")
    if L > 1:
        k_bad[1, :, L - 2] = float("inf")
    v = v.masked_fill(pad, 0.0)
    got = fused_causal(q, k_bad, v, scale, pad, S0 if with_state else None, z0 if with_state else None, chunk)
    want = elu_linear_causal(q, k.masked_fill(pad, 0.0), v, scale, pad, S0, z0)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    for name, a, b in zip(("out", "S", "z"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.isfinite(got[0]).all()


def test_rows_without_a_visible_key_give_zeros_never_nan():
    """A fully padded sequence, and the first positions of one whose first keys are padded: denominator 0, out 0."""
    q, k, v, kpm, _, _ = _inputs(torch.float64, 41, with_state=False)
    kpm[0] = False
    kpm[1, :6] = False
    pad = padded(kpm)
    k = k.masked_fill(pad, float("nan"))
    out, S, z = fused_causal(q, k, v.masked_fill(pad, 0.0), 1.0, pad, None, None, 32)
    assert (out[0] == 0).all() and (S[0] == 0).all() and (z[0] == 0).all()
    assert (out[1, :, :6] == 0).all() and torch.isfinite(out).all() and (out[1, :, 6:].abs().amax(-1) > 0).all()


def test_refuses_what_it_cannot_run():
    q, k, v, _, _, _ = _inputs(torch.float64, 8)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        fused_causal(q.half(), k.half(), v.half(), 1.0, None, None, None, 32)


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("L", [29, 2048 + 37])
def test_the_module_without_autograd_equals_its_autograd_path_and_the_torch_backend(with_padding, L, scale):
    kw = dict(num_heads=2, head_dim=8, scale=scale)
    fast = attnkit.build("linear", backend="numba", **kw)
    slow = attnkit.build("linear", backend="torch", **kw)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, 8, dtype=torch.float64) for _ in range(3))
    kpm = None
    if with_padding:
        kpm = torch.ones(2, L, dtype=torch.bool)
        kpm[0, -4:] = False
        kpm[1, :9] = False
        k[0, :, -1] = float("nan")
        v[0, :, -2] = float("inf")
    with torch.no_grad():
        a, sa = fast(q, k, v, causal=True, key_padding_mask=kpm, return_state=True)
        c, sc = slow(q, k, v, causal=True, key_padding_mask=kpm, return_state=True)
    qg = q.clone().requires_grad_()
    b, sb = fast(qg, k, v, causal=True, key_padding_mask=kpm, return_state=True)   # the unfused path
    assert torch.isfinite(a).all()
    for x in (b, c):
        torch.testing.assert_close(a, x.detach(), atol=1e-11, rtol=1e-9)
    for key in sa.data:
        torch.testing.assert_close(sa.data[key], sb.data[key].detach(), atol=1e-10, rtol=1e-9)
        torch.testing.assert_close(sa.data[key], sc.data[key], atol=1e-10, rtol=1e-9)


def test_the_module_takes_the_fused_path_only_without_autograd(monkeypatch):
    from attnkit_kernelized.linear import numba_fused

    calls = []
    real = numba_fused.fused_causal
    monkeypatch.setattr(numba_fused, "fused_causal", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attn = attnkit.build("linear", backend="numba")
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    with torch.no_grad():
        attn(q, k, v, causal=True)
    assert calls == [1]
    attn(q, k, v.requires_grad_(), causal=True).sum().backward()    # a gradient: the unfused path
    attn(q, k, v.detach(), causal=False)                             # non-causal: not this kernel
    assert calls == [1]
    attnkit.build("linear", backend="numba", feature_map="relu")(q, k, v.detach(), causal=True)
    attnkit.build("linear", backend="torch")(q, k, v.detach(), causal=True)
    assert calls == [1]


def test_streaming_without_autograd_continues_a_state():
    fast = attnkit.build("linear", backend="numba")
    slow = attnkit.build("linear", backend="torch")
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 50, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        full = slow(q, k, v, causal=True)
        a, st = fast(q[:, :, :23], k[:, :, :23], v[:, :, :23], causal=True, return_state=True)
        b, _ = fast(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], causal=True, state=st, return_state=True)
    torch.testing.assert_close(torch.cat([a, b], dim=2), full, atol=1e-11, rtol=1e-9)


def test_the_result_does_not_depend_on_the_thread_count(monkeypatch):
    """Each sequence is computed by one thread with the same code, whatever the number of threads the ranges go to
    (1, 2, 3: what a busy machine, see _busy, or ``torch.set_num_threads`` chooses): the same numbers, bit for bit."""
    from attnkit_kernelized import _numba

    q, k, v, kpm, S0, z0 = _inputs(torch.float64, 45)
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)
    results = []
    for n in (1, 2, 3):
        monkeypatch.setattr(_numba, "threads", lambda n=n: n)
        results.append(fused_causal(q, k, v, 0.7, pad, S0, z0, 32))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
