"""torch.func transforms and torch.compile over the default (numba) path: the kernels are torch.library
custom operators (fake shapes for tracing, registered backward); torch.func transforms run the torch path."""

from __future__ import annotations

import shutil

import pytest
import torch
from comparisons import build, close, rand
from torch.func import functional_call, grad, vmap

import attnkit
import attnkit_kernelized._ops

MECHANISMS = [("linear", {}), ("performer", {"num_features": 8}), ("rfa", {"num_features": 8}), ("fast-weight", {})]


def _pair(name, opts):
    """The default module (numba on CPU) and the same module on the torch backend."""
    fast = build(name, **opts)
    ref = build(name, backend="torch", **opts)
    ref.load_state_dict(fast.state_dict())
    return fast, ref


@pytest.mark.parametrize("name,opts", MECHANISMS, ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_func_grad_and_vmap_over_the_default_path(name, opts, causal):
    """torch.func.grad (inputs and, through functional_call, parameters) and torch.func.vmap used to fail
    inside the numba autograd Function; they agree with the torch path now."""
    if name == "fast-weight" and not causal:
        pytest.skip("fast-weight is causal only")
    fast, ref = _pair(name, opts)
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    close(grad(lambda q: fast(q, k, v, causal=causal).sum())(q),
          grad(lambda q: ref(q, k, v, causal=causal).sum())(q), torch.float64)
    qs = torch.randn(3, 1, 2, 9, 4, dtype=torch.float64)
    close(vmap(lambda x: fast(x, k, v, causal=causal))(qs),
          torch.stack([ref(x, k, v, causal=causal) for x in qs]), torch.float64)
    params = {n: p.detach() for n, p in fast.named_parameters()}
    if params:
        def loss(p, m):
            return functional_call(m, p, (q, k, v), {"causal": causal}).sum()
        for a, b in zip(grad(loss)(params, fast).values(), grad(loss)(params, ref).values()):
            close(a, b, torch.float64)


def test_operators_are_registered_with_fake_shapes():
    for op in ("numba_linear_attention", "numba_linear_product", "numba_gated_attention", "numba_delta_rule"):
        mod = {"numba_gated_attention": "rfa", "numba_delta_rule": "fast_weight"}.get(op, "linear")
        attnkit_kernelized._ops.backend_module(mod, "numba")
        assert hasattr(torch.ops.attnkit_kernelized, op)
    with torch._subclasses.FakeTensorMode():
        x = torch.empty(2, 3, 5, 4, dtype=torch.float64)
        out, den, S, z = torch.ops.attnkit_kernelized.numba_linear_attention(
            x, x, x[..., :3], torch.empty(2, 3, 4, 3, dtype=torch.float64), torch.empty(2, 3, 4, dtype=torch.float64),
            True, 4)
        assert out.shape == (2, 3, 5, 3) and den.shape == (2, 3, 5) and S.shape == (2, 3, 4, 3)


def test_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) of a small transformer with performer on the numba backend (a multi-head
    layer: transposed q, k, v): no graph break, the same outputs and gradients as eager (one test: compiling
    on CPU takes a few seconds)."""
    torch.manual_seed(0)
    model = attnkit.Transformer(16, 1, 2, "performer",
                                attention_options={"backend": "numba", "num_features": 8}).double().eval()
    x = rand((2, 9, 16), 0, torch.float64)
    kpm = torch.ones(2, 9, dtype=torch.bool)
    kpm[1, :2] = False
    eager = model(x, causal=True, key_padding_mask=kpm)
    g_eager = torch.autograd.grad(eager.square().mean(), [x, *model.parameters()])
    torch._dynamo.reset()
    # inductor needs a C++ compiler on CPU; without one, aot_eager still traces the whole graph (dynamo,
    # fake tensors through the operators' fake functions, the registered backward)
    compiled = torch.compile(model, fullgraph=True,
                             backend="inductor" if shutil.which("g++") or shutil.which("c++") else "aot_eager")
    out = compiled(x, causal=True, key_padding_mask=kpm)
    g = torch.autograd.grad(out.square().mean(), [x, *model.parameters()])
    close(out, eager, torch.float64)
    for a, b in zip(g, g_eager):
        close(a, b, torch.float64)
