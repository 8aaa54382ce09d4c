"""lsh, routing and sinkhorn with ``backend="triton"`` against the same module on ``torch``, outputs and gradients,
float64, on CPU tensors in the triton interpreter (the attention inside the reordered blocks runs the engine's
triton kernels through ``attend_plan``, log-sum-exp and its gradient included).

Skipped unless triton is importable and ``TRITON_INTERPRET=1`` was set before the run (the nox ``kernels``
session).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import attnkit

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                       reason="needs triton and TRITON_INTERPRET=1 set before the run"),
]

TOL = dict(atol=1e-9, rtol=1e-8)
#: name -> (options, L, shared-QK, takes key padding)
CASES = {
    "lsh": (dict(bucket_size=16, n_hashes=2, seed=3), 70, True, True),
    "routing": (dict(num_clusters=4, num_heads=2, head_dim=8), 64, False, True),
    "sinkhorn": (dict(block_size=16, num_heads=2, head_dim=8), 64, False, False),
}


def _pair(name, opts):
    torch.manual_seed(0)
    a = attnkit.build(name, backend="triton", **opts).double()
    b = attnkit.build(name, backend="torch", **opts).double()
    b.load_state_dict(a.state_dict())
    return a.eval(), b.eval()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backend_matches_torch_backend(name, causal, monkeypatch):
    from attnkit_sparse.engine import triton_ops

    calls = []
    real = triton_ops.attend
    monkeypatch.setattr(triton_ops, "attend", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    opts, L, shared_qk, padding = CASES[name]
    tri, ref = _pair(name, opts)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kpm = None
    if padding:
        kpm = torch.ones(2, L, dtype=torch.bool)
        kpm[1, -5:] = False
    outs, grads = [], []
    for mod in (tri, ref):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kk = leaves[0] if shared_qk else leaves[1]
        out = mod(leaves[0], kk, leaves[2], causal=causal, key_padding_mask=kpm)
        outs.append(out)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        grads.append(torch.autograd.grad((out * w).sum(), [leaves[0], leaves[2]] if shared_qk else leaves))
    assert calls, "the triton module never reached the triton kernels"
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("L, clusters", [(70, 4), (300, 2)])
@pytest.mark.parametrize("causal, padding", [(False, False), (True, True)])
def test_routing_cluster_widths_on_triton(L, clusters, causal, padding, monkeypatch):
    """70 tokens in 4 clusters route 18 rows each: the triton path widens every cluster to 32 slots (the unused ones
    masked as queries and keys) instead of refusing the block size. 300 tokens in 2 clusters route 150 rows, widened
    to 256 and cut into 64 x 64 blocks (a 1,024-row cluster as one block never finished compiling on an H100).
    Both equal the torch backend."""
    from attnkit_sparse.engine import triton_ops

    blocks = []
    real = triton_ops.attend
    monkeypatch.setattr(triton_ops, "attend", lambda q, k, v, plan, *a, **kw: blocks.append(plan.block_size[0])
                        or real(q, k, v, plan, *a, **kw))
    tri, ref = _pair("routing", dict(num_clusters=clusters, num_heads=2, head_dim=8))
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kpm = None
    if padding:
        kpm = torch.ones(2, L, dtype=torch.bool)
        kpm[0, :3] = False                                         # position 0, where the unused slots point
        k, v = (t.masked_fill(~kpm[:, None, :, None], float("nan")) for t in (k, v))
    outs, grads = [], []
    for mod in (tri, ref):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = mod(*leaves, causal=causal, key_padding_mask=kpm)
        outs.append(out)
        grads.append(torch.autograd.grad(out.sum(), leaves))
    assert blocks and max(blocks) <= 64 and min(blocks) >= 16
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for a, b in zip(*grads):
        torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), **TOL)
