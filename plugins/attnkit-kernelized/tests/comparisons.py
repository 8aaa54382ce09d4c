"""Tolerances and helpers shared by the tests that compare paths (naive reference, torch, numba, triton)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import attnkit
from attnkit import masks

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-8)}
#: what the conformance kit holds every backend to against the reference (float64)
REF_TOL = dict(atol=1e-9, rtol=1e-7)

#: triton runs on CPU tensors only in the interpreter, which triton reads when it defines the kernels
TRITON_READY = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
TRITON = [pytest.mark.triton,
          pytest.mark.skipif(not TRITON_READY, reason="needs triton and TRITON_INTERPRET=1 set before the run")]


def backends(*names: str) -> list:
    """pytest params of backend names; ``triton`` carries the triton mark."""
    return [pytest.param(b, marks=TRITON) if b == "triton" else b for b in names]


def close(a, b, dtype, factor=1.0):
    """assert_close at the dtype's tolerance, scaled by ``factor``."""
    torch.testing.assert_close(a, b, atol=TOL[dtype]["atol"] * factor, rtol=TOL[dtype]["rtol"] * factor)


def rand(shape, seed, dtype, positive=False, std=1.0):
    """A seeded leaf tensor needing grad: uniform [0, 1) when ``positive``, else normal with ``std``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64) if positive else \
        torch.randn(shape, generator=g, dtype=torch.float64) * std
    return x.to(dtype).requires_grad_()


def grads(outs, inputs, seed=3, allow_unused=False):
    """Gradients of ``inputs`` under a seeded random projection of ``outs``."""
    g = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum() for o in outs)
    return torch.autograd.grad(total, inputs, allow_unused=allow_unused)


def agree(got, want, inputs, dtype):
    """Every output of ``got`` equals ``want`` at the dtype's tolerance, and so does every gradient of
    ``inputs`` (under the same seeded projection), at 10x it."""
    for a, b in zip(got, want, strict=True):
        close(a, b, dtype)
    for a, b in zip(grads(got, inputs), grads(want, inputs), strict=True):
        close(a, b, dtype, 10)


def padding(B, S, pattern="mixed"):
    """A bool (B, S) key padding mask: batch 0 loses its last two keys, batch 1 its first (a causal query
    0 there sees nothing)."""
    kpm = torch.ones(B, S, dtype=torch.bool)
    kpm[0, -2:] = False
    kpm[1 % B, 0] = False
    return kpm


def build(name, dtype=torch.float64, **opts):
    """A module built under a fixed seed (same random features and parameters for every backend)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        attn = attnkit.build(name, **{"num_heads": 2, "head_dim": 4, **opts})
    return attn.to(dtype).eval()


def against_reference(name, opts, backend, *, causal, L, S, kpm=None, segment=None, std=1.0, tol=None):
    """A module on ``backend`` against the spec's naive reference in float64: outputs and gradients
    (inputs and parameters)."""
    attn = build(name, backend=backend, chunk_size=4, **opts)
    if segment is not None:
        attn.segment_length = segment
        if hasattr(attn, "trained_segment_length"):      # performer's training operator segments apart
            attn.trained_segment_length = segment
    ref_fn = attnkit.get_spec(name).load_reference()
    q, k, v = (rand(s, seed, torch.float64, std=std) for s, seed in (((2, 2, L, 4), 1), ((2, 2, S, 4), 2),
                                                                      ((2, 2, S, 3), 3)))
    params = [p for p in attn.parameters() if p.requires_grad]
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    mask = masks.resolve(None, causal=causal, key_padding_mask=kpm)
    ref = ref_fn(attn, q, k, v, mask=mask, positions=None)
    tol = tol or REF_TOL
    torch.testing.assert_close(out, ref, **tol)
    got = grads([out], [q, k, v, *params], allow_unused=True)
    want = grads([ref], [q, k, v, *params], allow_unused=True)
    for a, b in zip(got, want):
        if a is None or b is None:   # a parameter one form does not use (rfa's gate when non-causal): zero
            assert a is None or not a.any(), "the module has a gradient where the reference has none"
            assert b is None or not b.any(), "the reference has a gradient where the module has none"
            continue
        torch.testing.assert_close(a, b, atol=tol["atol"] * 10, rtol=tol["rtol"] * 10)
    return out


def module_run(m, q, k, v, kpm, split, *, parameters=False):
    """A causal call of module ``m`` on ``(q, k, v)`` with ``key_padding_mask=kpm``, whole (``split`` 0) or as two
    calls with the state carried from the first ``split`` positions to the rest; returns the output and the
    gradients of a fixed weighting of it w.r.t. ``q``, ``k``, ``v`` (and ``m``'s parameters with ``parameters``)."""
    if split:
        out, st = m(q[:, :, :split], k[:, :, :split], v[:, :, :split], causal=True,
                    key_padding_mask=kpm[:, :split], return_state=True)
        out2, _ = m(q[:, :, split:], k[:, :, split:], v[:, :, split:], causal=True,
                    key_padding_mask=kpm[:, split:], state=st, return_state=True)
        out = torch.cat([out, out2], 2)
    else:
        out = m(q, k, v, causal=True, key_padding_mask=kpm)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    inputs = (q, k, v, *m.parameters()) if parameters else (q, k, v)
    return out, torch.autograd.grad((out * weights).sum(), inputs)


def elu_linear_causal(q, k, v, scale, pad, S0, z0):
    """The plain expressions of causal ``linear`` with the ``elu`` map: ``phi = elu(scale x) + 1`` (padded keys 0),
    then normalised linear attention from ``(S0, z0)`` as an explicit masked product (0 where the denominator is 0,
    with no gradient through the division there); ``(out, S, z)``."""
    phi_q = torch.nn.functional.elu(q * scale) + 1
    phi_k = torch.nn.functional.elu(k * scale) + 1
    if pad is not None:
        phi_k = phi_k.masked_fill(pad, 0.0)
    A = (phi_q @ phi_k.transpose(-1, -2)).tril()
    num = A @ v + phi_q @ S0
    den = A.sum(-1) + (phi_q * z0.unsqueeze(-2)).sum(-1)
    empty = (den == 0).unsqueeze(-1)
    out = torch.where(empty, torch.zeros_like(num), num / torch.where(empty, torch.ones_like(num), den.unsqueeze(-1)))
    return out, S0 + phi_k.transpose(-1, -2) @ v, z0 + phi_k.sum(-2)


def fast_weight_features(q, k, pad, name, nu, normalize):
    """torch's ``fast-weight`` features: the module's map, sum-normalised when asked, padded keys 0."""
    from attnkit_kernelized.feature_maps import deterministic_feature_map, sum_normalized

    phi = deterministic_feature_map(name, nu=nu)
    fq, fk = phi(q), phi(k)
    if normalize:
        fq, fk = sum_normalized(fq), sum_normalized(fk)
    if pad is not None:
        fk = fk.masked_fill(pad, 0.0)
    return fq, fk
