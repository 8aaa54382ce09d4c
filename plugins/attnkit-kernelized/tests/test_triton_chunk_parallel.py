"""The chunk-parallel triton product of linear attention (``linear/triton_ops.py``): per-chunk states, a prefix
over the chunks, then every chunk's outputs in parallel. Lengths that are not a multiple of the chunk, carried
states, reverse and full modes, feature and value widths over one 64-wide block, half precision, empty inputs and
the retry with smaller chunks. ``triton`` mark: runs under ``TRITON_INTERPRET=1``; tiny shapes."""

from __future__ import annotations

import pytest
import torch
from comparisons import TRITON, grads

from attnkit_kernelized.linear import chunk as linear_chunk

pytestmark = TRITON

F64 = dict(atol=1e-12, rtol=1e-12)


def _ops():
    from attnkit_kernelized.linear import triton_ops
    return triton_ops


def _dense(x, y, w, S0, z0, mode):
    A = x @ y.transpose(-1, -2)
    if mode == "causal":
        A = A.tril()
    elif mode == "reverse":
        A = A.triu()
    return A @ w + x @ S0, A.sum(-1) + (x * z0[:, None]).sum(-1), S0 + y.transpose(-1, -2) @ w, z0 + y.sum(1)


def _inputs(N, L, S, DX, DW, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(N, L, DX, generator=g, dtype=torch.float64), torch.rand(N, S, DX, generator=g,
                                                                             dtype=torch.float64)
    w = torch.randn(N, S, DW, generator=g, dtype=torch.float64)
    S0, z0 = torch.randn(N, DX, DW, generator=g, dtype=torch.float64), torch.rand(N, DX, generator=g,
                                                                                 dtype=torch.float64)
    return x, y, w, S0, z0


@pytest.mark.parametrize("mode,L,S", [("causal", 53, 53), ("reverse", 53, 53), ("full", 53, 37), ("full", 5, 70)])
@pytest.mark.parametrize("DX,DW", [(5, 3), (70, 67)])
def test_product_across_chunk_boundaries(mode, L, S, DX, DW):
    """3 chunks of 16 and 5 positions, a nonzero carried state: an off-by-one in the chunk states, the prefix over
    them (forward or from the end) or the masks shows here. 70 features and 67 value columns span two 64-wide
    blocks each (the feature loop and the column blocks)."""
    x, y, w, S0, z0 = _inputs(2, L, S, DX, DW, L + S + DX)
    want = _dense(x, y, w, S0, z0, mode)
    got = _ops().triton_linear_product(x, y, w, S0, z0, mode, 16, True, False)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, **F64)
    plain, no_den, Sf, z_same = _ops().triton_linear_product(x, y, w, S0, z0, mode, 16, False, False)
    torch.testing.assert_close(plain, want[0], **F64)
    torch.testing.assert_close(Sf, want[2], **F64)
    assert no_den.shape == (2, 0) and torch.equal(z_same, z0)


@pytest.mark.parametrize("chunk", [1, 16, 100])
def test_chunk_size_changes_rounding_only(chunk):
    """chunk 1 rounds up to 16 positions, 100 is capped at 64: the same results either way (150 positions)."""
    x, y, w, S0, z0 = _inputs(1, 150, 150, 4, 3, chunk)
    for mode in ("causal", "reverse"):
        for a, b in zip(_ops().triton_linear_product(x, y, w, S0, z0, mode, chunk, True, False),
                        _dense(x, y, w, S0, z0, mode), strict=True):
            torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("causal,L,S", [(True, 53, 53), (False, 53, 37)])
def test_attention_outputs_states_and_gradients_match_torch(causal, L, S):
    """The differentiable operator (forward, final states, and the gradients of every input including the carried
    state: the backward runs the causal, reverse or full products) against the torch chunk path in float64."""
    g = torch.Generator().manual_seed(L + S)
    q = torch.rand(1, 2, L, 5, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.rand(1, 2, S, 5, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(1, 2, S, 3, generator=g, dtype=torch.float64).requires_grad_()
    S0 = torch.rand(1, 2, 5, 3, generator=g, dtype=torch.float64).requires_grad_()
    z0 = torch.rand(1, 2, 5, generator=g, dtype=torch.float64).requires_grad_()
    ins = (q, k, v, S0, z0)
    got = _ops().linear_attention(*ins, causal=causal, chunk=16)
    want = linear_chunk.linear_attention(*ins, causal=causal, chunk=16)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    for a, b in zip(grads(got, ins), grads(want, ins), strict=True):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("mode,L,S", [("causal", 53, 53), ("reverse", 53, 53), ("full", 21, 37)])
def test_float16_operands_go_to_dot_as_they_are(mode, L, S):
    """float16 inputs take the half-precision path (``X Y^T`` and ``Y^T W`` on float16 operands, float32 sums;
    ``A W`` and ``X S`` in TF32): float32 results close to float64 on the same rounded inputs, and a state
    beyond float16's range stays finite (it is never rounded to float16)."""
    ops = _ops()
    x, y, w, S0, z0 = (t.half() for t in _inputs(2, L, S, 20, 6, 7))
    w = w.abs() * 5000                 # sums of y w^T far beyond 65504
    assert ops._lowp(x, y, w) and not ops._lowp(x, y, w.float())
    assert not ops._lowp(*(t.bfloat16() for t in (x, y, w)))          # CPU bfloat16: widened (interpreter)
    got = ops.triton_linear_product(x, y, w, S0, z0, mode, 16, True, False)
    want = _dense(*(t.double() for t in (x, y, w, S0, z0)), mode)
    assert got[2].abs().max() > 65504
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=2e-3 * b.abs().max().item(), rtol=2e-3)


def test_bfloat16_on_cpu_is_widened():
    """bfloat16 under the interpreter widens to float32 (IEEE products): results equal the float32 run."""
    x, y, w, S0, z0 = (t.bfloat16() for t in _inputs(1, 37, 37, 6, 5, 9))
    got = _ops().triton_linear_product(x, y, w, S0, z0, "causal", 16, True, False)
    ref = _ops().triton_linear_product(*(t.float() for t in (x, y, w, S0, z0)), "causal", 16, True, False)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["causal", "reverse", "full"])
@pytest.mark.parametrize("N,L", [(0, 9), (2, 0)])
def test_empty_inputs(mode, N, L):
    """No sequence or no position: empty outputs; the final state is the carried one (plus every key in full
    mode, where S = 4 keys remain for L = 0)."""
    S = 4 if mode == "full" else L
    x, y, w, S0, z0 = _inputs(N, L, S, 3, 2, 1)
    out, den, Sf, zf = _ops().triton_linear_product(x, y, w, S0, z0, mode, 16, True, False)
    assert out.shape == (N, L, 2) and den.shape == (N, L)
    _, _, S_want, z_want = _dense(x, y, w, S0, z0, mode)
    torch.testing.assert_close(Sf, S_want, **F64)
    torch.testing.assert_close(zf, z_want, **F64)


def test_out_of_shared_memory_halves_the_chunk_for_both_kernels(monkeypatch):
    """The output kernel refusing 64-position chunks (as a GPU short of shared memory would) reruns both kernels
    with 32: the chunk states' layout must match the chunks the outputs read."""
    ops = _ops()

    class OutOfResources(Exception):
        pass

    seen = []
    real = ops.launch

    def fussy(kernel, grid, args, meta, shrink=()):
        seen.append((kernel.fn.__name__, meta["BLOCK_L"]))
        if kernel is ops._chunk_out_kernel and meta["BLOCK_L"] > 32:
            raise OutOfResources("shared memory")
        return real(kernel, grid, args, meta, shrink)

    monkeypatch.setattr(ops, "launch", fussy)
    x, y, w, S0, z0 = _inputs(1, 150, 150, 4, 3, 2)
    got = ops.triton_linear_product(x, y, w, S0, z0, "causal", 64, True, False)
    assert seen == [("_chunk_state_kernel", 64), ("_chunk_out_kernel", 64), ("_chunk_state_kernel", 32),
                    ("_chunk_out_kernel", 32)]
    for a, b in zip(got, _dense(x, y, w, S0, z0, "causal"), strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize("dtypes,lowp,prec", [
    # float16: half operands as they are, 3xTF32 for the products with a float32 factor (A, S): TF32 alone keeps
    # only float16's mantissa, and GPU run 5 measured dq 6.6e-3 with it against 4.1e-4 (docs/mechanisms/linear.md)
    ((torch.float16,) * 3, True, "tf32x3"),
    ((torch.float32, torch.float16, torch.float16), False, "tf32x3"),  # the backward's float32 gradient meets them
    ((torch.float32, torch.bfloat16, torch.bfloat16), False, "tf32"),  # bfloat16 is coarser than TF32: TF32 stays
    ((torch.float32,) * 3, False, "ieee"),
    ((torch.float64, torch.float16, torch.float32), False, "ieee"),
    ((torch.float16,) * 3 + (torch.float64,), False, "ieee"),       # a float64 state: float64 products
])
def test_operand_dtypes_pick_the_products(monkeypatch, dtypes, lowp, prec):
    """Which products each mix of dtypes gets (both kernels), and mixed operands reach the kernels in one dtype;
    the results agree with float64 on the same rounded inputs."""
    ops = _ops()
    seen = []
    real = ops.launch

    def spy(kernel, grid, args, meta, shrink=()):
        seen.append((meta["LOWP"], meta["PREC"], {a.dtype for a in args[:2] if isinstance(a, torch.Tensor)}))
        return real(kernel, grid, args, meta, shrink)

    monkeypatch.setattr(ops, "launch", spy)
    x, y, w, S0, z0 = _inputs(1, 21, 21, 6, 5, 4)
    x, y, w = (t.to(d) for t, d in zip((x, y, w), dtypes[:3], strict=True))
    S0, z0 = (t.to(dtypes[3] if len(dtypes) > 3 else torch.float32) for t in (S0, z0))
    got = ops.triton_linear_product(x, y, w, S0, z0, "causal", 16, True, False)
    assert len(seen) == 2 and all(s[:2] == (lowp, prec) and len(s[2]) == 1 for s in seen)
    want = _dense(*(t.double() for t in (x, y, w, S0, z0)), "causal")
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-4 * b.abs().max().item(), rtol=1e-4)
