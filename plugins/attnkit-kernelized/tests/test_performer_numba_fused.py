"""The performer's fused causal forward (performer/numba_fused.py: features and product in one kernel, no
autograd) against the plain torch expressions and the unfused paths, in float64 (float32 within rounding).

Padded keys hold NaN/Inf and must not reach a value; lengths are not multiples of the block; a state is
carried in and out; inputs beyond the bounded exponents fall back to the log-space form.
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit_kernelized.common import padded
from attnkit_kernelized.performer.numba_fused import fused_causal


def _torch_fused(q, k, v, w, scale, pad, S0, z0):
    """The plain expressions: positive features (queries shifted by their row maximum), then causal normalised
    linear attention from the state ``(S0, z0)`` as an explicit masked product; the bounds of the key exponents."""
    pq = q @ w.T
    phi_q = torch.exp(pq - pq.amax(-1, keepdim=True))
    lk = k @ w.T - 0.5 * scale * (k * k).sum(-1, keepdim=True)
    phi_k = torch.exp(lk)
    hi_src, lo_src = lk.clone(), lk.clone()
    if pad is not None:
        phi_k = phi_k.masked_fill(pad, 0.0)
        hi_src, lo_src = hi_src.masked_fill(pad, float("-inf")), lo_src.masked_fill(pad, float("inf"))
    A = (phi_q @ phi_k.transpose(-1, -2)).tril()
    num = A @ v + phi_q @ S0
    den = A.sum(-1) + (phi_q * z0.unsqueeze(-2)).sum(-1)
    out = torch.where(den.unsqueeze(-1) == 0, torch.zeros_like(num), num / den.unsqueeze(-1))
    S = S0 + phi_k.transpose(-1, -2) @ v
    z = z0 + phi_k.sum(-2)
    return out, S, z, hi_src.amax(dim=2), lo_src.amin(dim=(2, 3))


def _inputs(dtype, L, pad_tail=5, with_state=True):
    g = torch.Generator().manual_seed(1)
    B, H, D, M, E = 2, 3, 8, 24, 5
    q, k = (torch.randn(B, H, L, D, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    w = torch.randn(M, D, generator=g, dtype=dtype) * 0.6
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, L - pad_tail:] = False
    S0 = torch.rand(B, H, M, E, generator=g, dtype=dtype) if with_state else torch.zeros(B, H, M, E, dtype=dtype)
    z0 = torch.rand(B, H, M, generator=g, dtype=dtype) + 0.5 if with_state else torch.zeros(B, H, M, dtype=dtype)
    return q, k, v, w, kpm, S0, z0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L,chunk", [(1, 32), (37, 32), (70, 16), (64, 64), (45, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_the_fused_kernel_equals_the_torch_expressions(dtype, L, chunk, with_state):
    q, k, v, w, kpm, S0, z0 = _inputs(dtype, L, pad_tail=min(5, L), with_state=with_state)
    pad = padded(kpm)
    # padded keys hold anything (the module zeroes v there): they must not reach a value
    k_bad = k.clone()
    k_bad[1, :, L - 1] = float("nan")
    if L > 1:
        k_bad[1, :, L - 2] = float("inf")
    v = v.masked_fill(pad, 0.0)
    scale = 0.36
    got = fused_causal(q, k_bad, v, w, scale, pad, S0 if with_state else None, z0 if with_state else None, chunk)
    want = _torch_fused(q, k.masked_fill(pad, 0.0), v, w, scale, pad, S0, z0)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=1e-4)
    for name, a, b in zip(("out", "S", "z", "hi", "lo"), got, want, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.isfinite(got[0]).all()


def test_a_fully_padded_sequence_gives_zeros_and_no_exponent_range():
    q, k, v, w, kpm, _, _ = _inputs(torch.float64, 21, with_state=False)
    kpm[0] = False
    out, S, z, hi, lo = fused_causal(q, k, v.masked_fill(padded(kpm), 0.0), w, 1.0, padded(kpm), None, None, 32)
    assert (out[0] == 0).all() and (S[0] == 0).all() and (z[0] == 0).all()
    assert torch.isneginf(hi[0]).all() and torch.isposinf(lo[0]).all()
    assert torch.isfinite(out[1]).all()


def test_refuses_what_it_cannot_run():
    q, k, v, w, _, _, _ = _inputs(torch.float64, 8)
    with pytest.raises(ValueError, match="float32 or float64 CPU"):
        fused_causal(q.half(), k.half(), v.half(), w, 1.0, None, None, None, 32)


def _modules(dtype=torch.float64, **kw):
    kw = dict(num_heads=2, head_dim=8, num_features=16, seed=3, **kw)
    return (attnkit.build("performer", backend="numba", **kw).to(dtype),
            attnkit.build("performer", backend="torch", **kw).to(dtype))


@pytest.mark.parametrize("with_padding", [False, True])
@pytest.mark.parametrize("L", [29, 2048 + 37])    # one segment and several (the fused call takes all at once)
def test_the_module_without_autograd_equals_its_autograd_path_and_the_torch_backend(with_padding, L):
    fast, slow = _modules()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, L, 8, dtype=torch.float64) for _ in range(3))
    kpm = None
    if with_padding:
        kpm = torch.ones(2, L, dtype=torch.bool)
        kpm[0, -4:] = False
        kpm[1, 3:9] = False
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


def test_streaming_without_autograd_continues_a_state():
    fast, slow = _modules()
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 50, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        full = slow(q, k, v, causal=True)
        a, st = fast(q[:, :, :23], k[:, :, :23], v[:, :, :23], causal=True, return_state=True)
        b, _ = fast(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], causal=True, state=st, return_state=True)
    torch.testing.assert_close(torch.cat([a, b], dim=2), full, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("factor", [10.0, 30.0, 100.0])
def test_scaled_inputs_without_autograd_fall_back_and_keep_every_row(factor):
    """Beyond the bounded exponents the fused result is discarded for the log-space form: finite, no zero row,
    equal to the unfused path and near the float64 torch backend (float32, D = 64, M = 256 as in the issue)."""
    kw = dict(num_heads=2, head_dim=64, num_features=256, seed=0)
    fast = attnkit.build("performer", backend="numba", **kw)
    slow = attnkit.build("performer", backend="torch", **kw).double()
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 64) for _ in range(3))
    with torch.no_grad():
        a = fast(q * factor, k * factor, v, causal=True)
        ref = slow((q * factor).double(), (k * factor).double(), v.double(), causal=True)
    b = fast(q * factor, (k * factor).requires_grad_(), v, causal=True)    # the unfused segments
    assert torch.isfinite(a).all() and (a.abs().amax(-1) > 0).all()
    torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a.double(), ref, atol=1e-3, rtol=1e-2)


# the row maxima and minima the kernel takes: tests/test_vreduce.py (the core's attnkit.numba_vreduce)


def test_a_sequence_stops_at_the_first_block_beyond_the_bound_and_shows_it():
    q, k, v, w, _, _, _ = _inputs(torch.float64, 70, with_state=False)
    k = k.clone()
    k[0, 1, 40] *= 30.0                      # one key far out, in the second block of 32
    full = fused_causal(q, k, v, w, 0.36, None, None, None, 32)
    bound = float(full[3][0, 1].amax().abs().max(full[4][0, 1].abs())) / 2
    out, S, z, hi, lo = fused_causal(q, k, v, w, 0.36, None, None, None, 32, bound)
    assert hi[0, 1].amax() > bound or lo[0, 1] < -bound     # the caller sees the violation
    others = torch.ones(2, 3, dtype=torch.bool)
    others[0, 1] = False
    within = (full[3].amax(-1) <= bound) & (full[4] >= -bound)
    keep = others & within                   # sequences within the bound ran to the end: unchanged
    assert keep.sum() >= 4
    for a, b in zip((out, S, z, hi, lo), full, strict=True):
        torch.testing.assert_close(a[keep], b[keep], atol=0, rtol=0)


def test_the_result_does_not_depend_on_the_thread_count(monkeypatch):
    """Each sequence is computed by one thread with the same code, whatever the number of threads the ranges go to
    (1, 2, 3: what a busy machine, see _busy, or ``torch.set_num_threads`` chooses): the same numbers, bit for bit."""
    from attnkit_kernelized import _numba

    q, k, v, w, kpm, S0, z0 = _inputs(torch.float64, 45)
    pad = padded(kpm)
    v = v.masked_fill(pad, 0.0)
    results = []
    for n in (1, 2, 3):
        monkeypatch.setattr(_numba, "threads", lambda n=n: n)
        results.append(fused_causal(q, k, v, w, 0.36, pad, S0, z0, 32))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)
