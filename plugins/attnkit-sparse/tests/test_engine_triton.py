"""The triton backend of the engine against the dense reference, on CPU tensors in the triton interpreter.

Skipped unless triton is importable and ``TRITON_INTERPRET=1`` was set before the run
(the nox ``kernels`` session does both and runs ``-m triton``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_engine import CASES, KPM, B, H, _broken, agree, inputs

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


def _explicit_case(L=45, S=40, bq=16, bk=16, seed=3):
    """An explicit plan as content-based mechanisms build them: per (batch, head) key blocks and random tile
    masks, one query block visiting nothing and a row inside a visited tile with no allowed key."""
    from attnkit_sparse.engine import explicit_plan

    g = torch.Generator().manual_seed(seed)
    nq, nk = -(-L // bq), -(-S // bk)
    kv_idx = torch.full((B, H, nq, 2), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            for n in range(1, nq):  # query block 0 visits nothing
                picks = torch.randperm(nk, generator=g)[:2].sort().values
                kv_idx[b, h, n, : 1 + (n + b + h) % 2] = picks[: 1 + (n + b + h) % 2]
    bank = torch.rand(B, H, nq, 2, bq, bk, generator=g) < 0.6
    bank[..., 3, :] = False  # row 3 of every tile: no key at all
    return explicit_plan(kv_idx, bank, L, S)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attend_plan_with_its_log_sum_exp_matches_the_torch_backend(dtype):
    """triton is an ``attend_plan`` backend: output and log-sum-exp (-inf for rows with no key) agree with the
    torch backend, and so do the gradients of q, k, v through both (lsh combines its rounds by the lse)."""
    from attnkit_sparse.engine import attend_plan

    L, S = 45, 40
    p = _explicit_case(L, S)
    q, k, v = inputs(L, S, dtype)
    got_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = attend_plan(*got_leaves, p, backend="triton", return_lse=True)
    ref_out, ref_lse = attend_plan(*ref_leaves, p, backend="torch", return_lse=True)
    tol = dict(atol=1e-10, rtol=1e-9) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(out, ref_out, **tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and bool(torch.isneginf(lse).any())
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin], ref_lse[fin], **tol)
    gen = torch.Generator().manual_seed(9)
    g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(dtype)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(dtype)

    def loss(o, s):
        return (o * g_out).sum() + (torch.where(torch.isfinite(s), s, torch.zeros_like(s)) * g_lse).sum()

    got = torch.autograd.grad(loss(out, lse), got_leaves)
    want = torch.autograd.grad(loss(ref_out, ref_lse), ref_leaves)
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"d{name}: {m}")
    # the lse's gradient is really used: without it dq differs
    only_out = torch.autograd.grad((attend_plan(*got_leaves, p, backend="triton") * g_out).sum(), got_leaves[0])[0]
    assert not torch.allclose(only_out, got[0])


def test_attend_plan_refuses_triton_for_blocks_it_cannot_tile():
    from attnkit_sparse.engine import attend_plan, explicit_plan

    p = explicit_plan(torch.zeros(1, 1, 5, 1, dtype=torch.long), torch.ones(1, 1, 5, 1, 8, 8, dtype=torch.bool),
                      37, 37)
    with pytest.raises(InvalidInputError, match="powers of two >= 16"):
        attend_plan(*inputs(37, 37), p, backend="triton", return_lse=True)


def test_a_reused_plan_converts_its_bank_once():
    """The int8 bank the kernels read is made once per plan and passed as it is (no copy per call)."""
    from attnkit_sparse.engine import triton_ops

    p = plan(masks.causal() & masks.sliding_window(20), 1, 2, 70, 70, block_size=16)
    bank8 = p.int8_bank()
    assert bank8.dtype == torch.int8 and bank8 is p.int8_bank() and triton_ops._bank8(bank8) is bank8
    assert p.bank.shape[0] > 0 and torch.equal(bank8.bool(), p.bank)
    empty = plan(None, 1, 1, 32, 32, block_size=16)                  # no partial tile: one placeholder entry
    assert empty.bank.shape[0] == 0 and empty.int8_bank().shape == (1, 16, 16)
    q, k, v = (t.requires_grad_() for t in inputs(70, 70))
    out = triton_ops.attend(q, k, v, p, 0.125)
    ref = reference_attend(q, k, v, masks.causal() & masks.sliding_window(20), scale=0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    assert p.int8_bank() is bank8
