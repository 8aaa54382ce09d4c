"""torch.compile traces a small model with each memory attention without graph breaks, equal to eager.

``fullgraph=True`` with the ``aot_eager`` backend (as ``test_compile.py``): a graph break is an error.
One forward without state (both backends of transformer-xl), and segment by segment with the state
carried (``forward(..., state=..., return_state=True)``). Skipped unless ``attnkit_memory`` is importable.
"""

from __future__ import annotations

import pytest
import torch

import attnkit

pytest.importorskip("attnkit_memory", reason="attnkit-memory is not installed")

CASES = [
    ("transformer-xl", {"backend": "sdpa", "mem_len": 4}),
    ("transformer-xl", {"backend": "torch", "mem_len": 4}),
    ("compressive", {"backend": "sdpa", "mem_len": 2, "cmem_len": 2, "compression_rate": 2}),
    ("memory-tokens", {"num_memory": 2}),
]


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{o.get('backend', 'torch')}" for n, o in CASES])
def test_compiled_memory_model_equals_eager_without_graph_breaks(name, options):
    torch.manual_seed(0)
    model = attnkit.Transformer(16, 1, 2, name, attention_options=options).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64, requires_grad=True)
    want = model(x, causal=True)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = compiled(x, causal=True)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(g_got, g_want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}-{o.get('backend', 'torch')}" for n, o in CASES])
def test_compiled_segments_with_state_equal_eager(name, options):
    torch.manual_seed(0)
    model = attnkit.Transformer(16, 1, 2, name, attention_options=options).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)

    def segments(m):
        state, outs = None, []
        for s in range(0, 9, 3):
            o, state = m(x[:, s:s + 3], causal=True, state=state, return_state=True)
            outs.append(o)
        return torch.cat(outs, 1)

    want = segments(model)
    torch._dynamo.reset()
    got = segments(torch.compile(model, fullgraph=True, backend="aot_eager"))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
