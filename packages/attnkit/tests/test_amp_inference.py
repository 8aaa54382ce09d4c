"""Attention under PyTorch's execution modes: ``torch.autocast`` and ``torch.inference_mode``.

Under autocast every implementation behaves as SDPA does (the base class casts q, k, v once to the autocast
dtype and runs the implementation with autocast off: :mod:`attnkit.amp`). Caches built during an
``inference_mode`` call are ordinary tensors (:func:`attnkit.caching.kept_tensors`), so a validation pass
does not break the next training step.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import attnkit
from attnkit.amp import autocast_dtype
from attnkit.caching import kept_tensors
from attnkit.context_parallel import context_parallel
from attnkit.first_order import first_order, first_order_path


def _qkv(dtype=torch.float32, L=7, S=7, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, n, 8, generator=g, dtype=dtype).requires_grad_(requires_grad) for n in (L, S, S)]


class Prefix(attnkit.Attention):
    """``out_i = q_i * sum_{j <= i} k_j * v_j`` times a float32 parameter, split as an exclusive prefix; records
    the dtype it computes in and whether autocast was on (``seen``)."""

    capabilities = attnkit.Capabilities(causal=True, noncausal=False, cross=False, context_parallel=True,
                                        dtypes=("float32", "float64", "bfloat16"))

    def __init__(self, **kw):
        super().__init__(**kw)
        self.w = torch.nn.Parameter(torch.ones(()))

    def _attend(self, q, k, v, ctx):
        self.seen = (q.dtype, torch.is_autocast_enabled(q.device.type))
        return q * torch.cumsum(k * v, dim=2) * self.w.to(q.dtype)

    def _context_parallel(self, q, k, v, cp):
        self.seen = (q.dtype, torch.is_autocast_enabled(q.device.type))
        summaries = cp.gather([(k * v).sum(dim=2)])
        prefix = cp.exclusive_prefix(summaries, lambda a, b: [a[0] + b[0]])
        run = torch.cumsum(k * v, dim=2)
        if prefix is not None:
            run = run + prefix[0].unsqueeze(2)
        return q * run * self.w.to(q.dtype)


def test_autocast_dtype_follows_the_device_and_the_declared_dtypes():
    cpu = torch.device("cpu")
    assert autocast_dtype(cpu, ("float32", "bfloat16")) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_dtype(cpu, ("float32", "bfloat16")) == torch.bfloat16
        assert autocast_dtype(cpu, ("float32", "float64")) == torch.float32
        assert autocast_dtype(torch.device("meta"), ("float32", "bfloat16")) is None


def test_softmax_under_autocast_matches_sdpa_dtype_and_the_cast_inputs():
    attn = attnkit.build("softmax")
    q, k, v = _qkv(requires_grad=True)
    bias = torch.randn(1, 1, 7, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q, k, v, attn_mask=bias)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert out.dtype == sdpa.dtype == torch.bfloat16
    ref = attn(*(t.detach().bfloat16() for t in (q, k, v)), attn_mask=bias)
    assert torch.equal(out, ref)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_the_implementation_sees_the_cast_inputs_with_autocast_off():
    with attnkit.registered(Prefix, name="amp-prefix"):
        attn = attnkit.build("amp-prefix")
        q, k, v = _qkv(requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attn(q, k, v, causal=True)
        assert attn.seen == (torch.bfloat16, False) and out.dtype == torch.bfloat16
        out.float().sum().backward()
        assert q.grad.dtype == attn.w.grad.dtype == torch.float32


def test_autocast_leaves_float64_inputs_alone():
    attn = attnkit.build("softmax")
    q, k, v = _qkv(torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q, k, v, causal=True)
    assert out.dtype == torch.float64
    assert torch.equal(out, attn(q, k, v, causal=True))


def test_undeclared_autocast_dtype_runs_in_float32():
    caps = attnkit.Capabilities(causal=True, noncausal=False, cross=False, dtypes=("float32", "float64"))
    with attnkit.registered(Prefix, name="amp-prefix-f32", capabilities=caps):
        attn = attnkit.build("amp-prefix-f32")
        q, k, v = _qkv()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = attn(q, k, v, causal=True)
        assert out.dtype == torch.float32 and attn.seen == (torch.float32, False)
        assert torch.equal(out, attn(q, k, v, causal=True))


def test_step_under_autocast_streams_in_the_autocast_dtype():
    attn = attnkit.build("softmax")
    q, k, v = _qkv()
    state = attn.init_state(2)
    outs = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(7):
            o, state = attn.step(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], state)
            outs.append(o)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    whole = attn(*(t.bfloat16() for t in (q, k, v)), causal=True)
    torch.testing.assert_close(torch.cat(outs, 2), whole, atol=2e-2, rtol=2e-2)


def test_context_parallel_under_autocast_casts_like_forward():
    """One gloo rank: context_parallel under autocast gives the split form on the inputs cast to bfloat16."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    attn = Prefix()
    q, k, v = _qkv()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdv')}", rank=0, world_size=1)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = context_parallel(attn, q, k, v)
            assert attn.seen == (torch.bfloat16, False)
            ref = context_parallel(attn, *(t.bfloat16() for t in (q, k, v)))
        finally:
            dist.destroy_process_group()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)


def test_kept_tensors_are_ordinary_under_inference_mode():
    with torch.inference_mode():
        plain = torch.ones(3)
        with kept_tensors():
            kept = torch.ones(3)
            assert not torch.is_grad_enabled()
        after = torch.ones(3)
    assert plain.is_inference() and after.is_inference()
    assert not kept.is_inference()
    with kept_tensors():                     # outside inference mode: nothing changes
        assert torch.is_grad_enabled()


def test_a_mask_block_index_built_under_inference_mode_serves_training():
    m = attnkit.masks.sliding_window(3) & attnkit.masks.causal()
    with torch.inference_mode():
        idx = m.block_index(1, 1, 16, 16, block_size=4)
    assert not idx.state.is_inference()
    attn = attnkit.build("softmax")
    q, k, v = _qkv(L=16, S=16, requires_grad=True)
    with torch.inference_mode():
        attn(q, k, v, mask=m)
    attn(q, k, v, mask=m).sum().backward()
    assert torch.isfinite(q.grad).all()


def test_kept_tensors_traces_in_torch_compile_fullgraph():
    def f(x):
        with kept_tensors():
            y = x + 1
        return y * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.randn(4)
    assert torch.equal(compiled(x), f(x))


# ---------------------------------------------------------------- first-order backward passes
class _Cube(torch.autograd.Function):
    """``x³``; the backward reads ``3x²`` saved as a constant (right to first order only)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        ctx.d = (3 * x * x).detach()
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        return g * ctx.d


class _GuardedCube(_Cube):
    backward = staticmethod(first_order(_Cube.backward))


def test_first_order_refuses_the_second_derivative_a_plain_backward_loses():
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(_Cube.apply(x).sum(), x, create_graph=True)
    assert g.requires_grad is False                      # a constant: a second backward silently loses 6x
    g, = torch.autograd.grad(_GuardedCube.apply(x).sum(), x, create_graph=True)
    assert torch.equal(g.detach(), 3 * x.detach() ** 2)  # first derivatives unchanged
    with pytest.raises(attnkit.UnsupportedFeatureError, match="_GuardedCube.*second derivatives"):
        g.sum().backward()
    g, = torch.autograd.grad(_GuardedCube.apply(x).sum(), x)   # without create_graph: plain tensors
    assert not g.requires_grad


class _SavedCube(torch.autograd.Function):
    """``x³`` whose first-order backward reads ``x`` back from ``ctx.saved_tensors`` (detached)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    @first_order
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g * 3 * x.detach() ** 2


def test_first_order_refuses_under_checkpointing_too():
    """torch.utils.checkpoint allows one unpack of a saved tensor, which the backward made: the refusal is then
    anchored on the gradients themselves (it was a CheckpointError from the wrapper's own read)."""
    from torch.utils.checkpoint import checkpoint
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    y = checkpoint(lambda t: _SavedCube.apply(t * 1.0), x, use_reentrant=False)
    g, = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert torch.equal(g.detach(), 3 * x.detach() ** 2)
    with pytest.raises(attnkit.UnsupportedFeatureError, match="_SavedCube.*second derivatives"):
        g.sum().backward()


def test_first_order_path_keeps_first_derivatives_and_refuses_second():
    x = torch.tensor([0.5, -1.5], dtype=torch.float64, requires_grad=True)
    y = first_order_path(x * x, "the test's path")
    g, = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert torch.equal(g.detach(), 2 * x.detach())
    with pytest.raises(attnkit.UnsupportedFeatureError, match="the test's path"):
        g.sum().backward()
    assert first_order_path(x.detach()) is not None
