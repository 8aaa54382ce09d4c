"""The triton backend of the engine against the dense reference, on CPU tensors in the triton interpreter.

Skipped unless triton is importable and ``TRITON_INTERPRET=1`` was set before the run
(the nox ``kernels`` session does both and runs ``-m triton``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_engine import CASES, KPM, _broken, agree, inputs

from attnkit import masks
from attnkit.errors import InvalidInputError
from attnkit_sparse.engine import attend, plan, reference_attend

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                       reason="needs triton and TRITON_INTERPRET=1 set before the run"),
]

# triton takes block sizes that are powers of two >= 16
TRITON_CASES = [c for c in CASES if c != "block_8"]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_outputs_and_gradients_match_the_reference(case):
    L, S, make, kw = CASES[case]
    agree("triton", *inputs(L, S), make(), **kw)


@pytest.mark.parametrize("poison", [float("nan"), 1e30])
def test_padded_keys_have_no_influence(poison):
    q, k, v = inputs(37, 37)
    pad = ~KPM[:, None, :, None]
    clean = (k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0))
    agree("triton", q, k.masked_fill(pad, poison), v.masked_fill(pad, poison),
          masks.key_padding(KPM) & masks.sliding_window(8, 8), ref_kv=clean)


def test_float32():
    agree("triton", *inputs(37, 37, torch.float32), masks.causal() & masks.sliding_window(20))


def test_the_comparison_catches_a_broken_plan(monkeypatch):
    _broken(monkeypatch, "drop_partial_masks")
    with pytest.raises(AssertionError):
        agree("triton", *inputs(37, 37), masks.causal() & masks.sliding_window(20))


def test_block_size_must_suit_tl_dot():
    with pytest.raises(InvalidInputError, match="powers of two >= 16"):
        agree("triton", *inputs(37, 37), masks.causal(), block_size=8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    """float16 goes to ``tl.dot`` as it is (the tensor-core path), bfloat16 is widened under the interpreter:
    both against the float64 reference at half precision's tolerance, output and gradients; the
    log-sum-exp stays float32."""
    from attnkit_sparse.engine import triton_ops

    q, k, v = inputs(75, 75)
    m = masks.causal() & masks.sliding_window(20)
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().to(dtype).double().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves, m, backend="triton", block_size=16)
    ref = reference_attend(*ref_leaves, m)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * g).sum(), leaves)
    want = torch.autograd.grad((ref * g).sum(), ref_leaves)
    for name, a, b in zip("qkv", got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=5e-2, rtol=5e-2, msg=lambda msg, name=name: f"d{name}: {msg}")
    p = plan(m, *q.shape[:2], 75, 75, block_size=16)
    _, lse = triton_ops.triton_block_attention(*leaves, p.kv_count, p.kv_idx, p.kv_tile, p.q_count, p.q_idx,
                                               p.q_tile, p.bank, 16, 16, 0.125)
    assert lse.dtype == torch.float32
