"""SOFT's chunked kernel product (``soft/chunk.py``, the CPU path) against autograd through the plain expression.

``gauss(q, K~) @ (Z @ (gauss(k, K~)^T @ V))`` in float64: values and the
gradients in q, k, K~, Z and V, with q is k (the paper's form, one kernel
matrix and the two gradient terms summed per chunk) and q, k distinct, chunk
sizes that divide L, do not, and exceed it, with the kernel blocks kept for the
backward, recomputed (no grad) and kept in the reused workspace (no grad);
gradcheck on both forms; and the module on CPU takes this path.
"""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank.soft import chunk
from attnkit_lowrank.soft.chunk import release_workspace, soft_kernel_product
from attnkit_lowrank.soft.module import gaussian_kernel

import attnkit

F64 = torch.float64


def _inputs(shared: bool, L: int = 13, m: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, 3, L, 5, generator=g, dtype=F64) * 0.5).requires_grad_(True)
    k = q if shared else (torch.randn(2, 3, L, 5, generator=g, dtype=F64) * 0.5).requires_grad_(True)
    kb = (torch.randn(2, 3, m, 5, generator=g, dtype=F64) * 0.5).requires_grad_(True)
    z = torch.randn(2, 3, m, m, generator=g, dtype=F64).requires_grad_(True)
    v = torch.randn(2, 3, L, 6, generator=g, dtype=F64).requires_grad_(True)
    return q, k, kb, z, v


def _plain(q, k, kb, z, v, scale):
    return gaussian_kernel(q, kb, scale) @ (z @ (gaussian_kernel(k, kb, scale).transpose(-1, -2) @ v))


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("rows", [1, 4, 5, 13, 64])
def test_values_and_gradients_equal_the_plain_expression(shared, rows):
    q, k, kb, z, v = _inputs(shared)
    out = soft_kernel_product(q, k, kb, z, v, 0.7, rows)
    ref = _plain(q, k, kb, z, v, 0.7)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    with torch.no_grad():       # the recomputing forward (no block kept)
        torch.testing.assert_close(soft_kernel_product(q, k, kb, z, v, 0.7, rows, keep=False), ref,
                                   atol=1e-12, rtol=1e-10)
    # keep=False where a backward is coming still keeps the blocks (the gradients below are those of `out`)
    out2 = soft_kernel_product(q, k, kb, z, v, 0.7, rows, keep=False)
    torch.testing.assert_close(torch.autograd.grad(out2.sum(), v)[0],
                               torch.autograd.grad(ref.sum(), v, retain_graph=True)[0], atol=1e-11, rtol=1e-9)
    ins = (q, kb, z, v) if shared else (q, k, kb, z, v)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, ins, w), torch.autograd.grad(ref, ins, w)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("shared", [True, False])
def test_the_reused_workspace_gives_the_plain_values(shared, monkeypatch):
    """No backward coming: the blocks go into the thread's kept workspace. Calls of growing and shrinking sizes,
    float32 after float64, a call above the size cap (fresh blocks), grad mode on with no input requiring grad,
    and a call with a backward in between: each equals the plain expression, and the output never aliases the
    workspace (a later call leaves an earlier output unchanged)."""
    release_workspace()
    outs = []
    for L, m, rows, dtype in ((13, 4, 5, F64), (40, 6, 7, F64), (9, 3, 64, F64), (13, 4, 4, torch.float32)):
        q, k, kb, z, v = (t.detach().to(dtype) for t in _inputs(shared, L=L, m=m, seed=L))
        with torch.no_grad():
            out = soft_kernel_product(q, k, kb, z, v, 0.7, rows)
        tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == F64 else {"atol": 1e-4, "rtol": 1e-4}
        torch.testing.assert_close(out, _plain(q, k, kb, z, v, 0.7), **tol)
        outs.append((out.clone(), out))
        assert chunk._workspace.buf is not None and out.data_ptr() != chunk._workspace.buf.data_ptr()
    q, k, kb, z, v = (t.detach() for t in _inputs(shared, L=11, m=5, seed=3))
    torch.testing.assert_close(soft_kernel_product(q, k, kb, z, v, 0.7, 4), _plain(q, k, kb, z, v, 0.7),
                               atol=1e-12, rtol=1e-10)                                 # grad mode, no grad needed
    q, k, kb, z, v = _inputs(shared, L=11, m=5, seed=4)
    out = soft_kernel_product(q, k, kb, z, v, 0.7, 3)                                   # with a backward
    ref = _plain(q, k, kb, z, v, 0.7)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    with torch.no_grad():                                                               # overwrites the workspace
        soft_kernel_product(*(t.detach() * 1.1 for t in (q, k, kb, z, v)), 0.7, 3)
    for a, b in zip(torch.autograd.grad(out.sum(), v), torch.autograd.grad(ref.sum(), v)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    monkeypatch.setattr(chunk, "WORKSPACE_MAX_BYTES", 64)                               # above the cap: fresh
    release_workspace()
    q, k, kb, z, v = (t.detach() for t in _inputs(shared, L=13, m=4, seed=5))
    with torch.no_grad():
        torch.testing.assert_close(soft_kernel_product(q, k, kb, z, v, 0.7, 5), _plain(q, k, kb, z, v, 0.7),
                                   atol=1e-12, rtol=1e-10)
    assert chunk._workspace.buf is None
    for kept, out in outs:
        assert torch.equal(kept, out)
    release_workspace()


@pytest.mark.parametrize("shared", [True, False])
def test_gradcheck(shared):
    q, k, kb, z, v = _inputs(shared, L=7, m=3, seed=1)
    if shared:
        fn = lambda q_, kb_, z_, v_: soft_kernel_product(q_, q_, kb_, z_, v_, 0.9, 3)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, kb, z, v))
    else:
        fn = lambda q_, k_, kb_, z_, v_: soft_kernel_product(q_, k_, kb_, z_, v_, 0.9, 3)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, kb, z, v))


def test_an_expanded_output_gradient_and_float32():
    """``out.sum().backward()`` hands an expanded (stride-0) gradient; float32 agrees with float64 to its rounding."""
    q, _, kb, z, v = _inputs(True, L=40, m=6, seed=2)
    z = torch.eye(6, dtype=F64).expand(2, 3, 6, 6).clone().requires_grad_(True)
    ref = _plain(q, q, kb, z, v, 0.5)
    g_ref = torch.autograd.grad(ref.sum(), (q, kb, v))
    q32, kb32, z32, v32 = (t.detach().float().requires_grad_(True) for t in (q, kb, z, v))
    out = soft_kernel_product(q32, q32, kb32, z32, v32, 0.5, 16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(out.sum(), (q32, kb32, v32)), g_ref):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)


def test_the_module_on_cpu_runs_the_chunked_product(monkeypatch):
    import attnkit_lowrank.soft.module as soft_module
    calls = []
    real = soft_module.soft_kernel_product
    monkeypatch.setattr(soft_module, "soft_kernel_product", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    attn = attnkit.build("soft", head_dim=5, stride=4).double()
    q, _, _, _, v = _inputs(True, L=16)
    from attnkit_lowrank.soft.naive import reference
    torch.testing.assert_close(attn(q, q, v), reference(attn, q, q, v), atol=1e-10, rtol=1e-8)
    assert calls == [1]
