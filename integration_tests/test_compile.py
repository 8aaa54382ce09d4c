"""torch.compile traces a small model with each family's fast path, without graph breaks, equal to eager.

Kernels are registered as torch.library custom operators with fake (meta)
implementations and registered autograd, so dynamo sees one opaque node per
kernel call instead of breaking the graph at numba/triton code.
"""

from __future__ import annotations

import pytest
import torch

import attnkit

# the fast path of each family on CPU, and the options that keep the model tiny
CASES = [
    ("softmax", "sdpa", {}),
    ("linear", "numba", {}),
    ("performer", "numba", {"num_features": 16}),
]


def _available(name: str) -> bool:
    try:
        attnkit.get_spec(name)
    except LookupError:
        return False
    return True


@pytest.mark.parametrize("name, backend, options", CASES, ids=[c[0] for c in CASES])
def test_compiled_model_equals_eager_without_graph_breaks(name, backend, options):
    if not _available(name):
        pytest.skip(f"{name} is not installed")
    torch.manual_seed(0)
    model = attnkit.Transformer(16, 1, 2, name, attention_options={"backend": backend, **options})
    model = model.double()
    x = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True)
    want = model(x, causal=True)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    got = compiled(x, causal=True)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(g_got, g_want, atol=1e-10, rtol=1e-8)
