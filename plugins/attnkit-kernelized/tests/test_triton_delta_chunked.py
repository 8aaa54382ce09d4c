"""The chunked WY / UT-transform triton kernels of ``fast-weight`` (the delta rule), piece by piece.

``test_triton_gated_delta.py`` holds the operator against the torch chunk form (float32 and float64, odd lengths,
a carried state, streaming, gradcheck, half inputs, opcheck); this module checks what is particular to the chunked
kernels: the in-kernel triangular solve against torch's inverse at every chunk size, the chunk sizes against each
other, several feature and value blocks (the partial ``d beta`` sums), and that deliberately broken copies of the
kernels (an off-by-one in each triangular mask) fail the comparison the other tests rely on. Every test carries
the ``triton`` mark (``TRITON_INTERPRET=1`` on CPU, tiny shapes).
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
from comparisons import TRITON, agree, grads, rand

from attnkit_kernelized.fast_weight import chunk as delta_chunk

pytestmark = TRITON


def _ops():
    from attnkit_kernelized.fast_weight import triton_ops

    return triton_ops


def _inputs(L, dtype=torch.float64, M=8, E=4, B=1, H=2):
    """Sum-normalised non-negative keys (as the module's features) and write strengths in (0, 1)."""
    q = rand((B, H, L, M), 0, dtype, positive=True)
    k0 = torch.rand(B, H, L, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    k = (k0 / k0.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    v = rand((B, H, L, E), 2, dtype)
    beta = torch.rand(B, H, L, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    S0 = rand((B, H, M, E), 4, dtype)
    return q, k, v, beta.to(dtype).requires_grad_(), S0


@pytest.mark.parametrize("block,dtype", [(16, torch.float64), (32, torch.float64), (64, torch.float16)], ids=str)
def test_in_kernel_solve_is_the_inverse(block, dtype):
    """The stored ``T`` of every chunk (forward substitution in registers) equals torch's inverse of
    ``I + tril(diag(beta) K K^T, -1)``; rows past the end of the last chunk hold the identity (beta = 0 there).
    Keys of norm ~1 and beta near 1 make every subdiagonal entry count. 64-position chunks run only for half
    inputs (float32 and float64 stop at 32, ``_TILES``): float16 there, ``T`` in float32 against the float64
    inverse of the rounded inputs."""
    L = block + block // 2 + 3
    q, k, v, beta, S0 = (t.detach() for t in _inputs(L, M=4, H=1))
    k = (k / k.norm(dim=-1, keepdim=True)).to(dtype)
    q, v, S0 = q.to(dtype), v.to(dtype), S0.float() if dtype == torch.float16 else S0
    beta = (0.5 + 0.5 * beta).to(dtype)
    T = _ops().triton_delta_rule(q, k, v, beta, S0, block)[3]                            # (B, H, nc, C, C)
    nc = T.shape[2]
    assert T.shape[-1] == block and nc == -(-L // block)
    k, beta = k.double(), beta.double()
    kp = torch.nn.functional.pad(k, (0, 0, 0, nc * block - L)).unflatten(2, (nc, block))
    bp = torch.nn.functional.pad(beta, (0, nc * block - L)).unflatten(2, (nc, block))
    A = torch.eye(block, dtype=k.dtype) + (bp[..., None] * (kp @ kp.transpose(-1, -2))).tril(-1)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(T.double(), torch.linalg.inv(A), **tol)
    assert (A - torch.eye(block, dtype=k.dtype)).abs().max() > 0.4        # a solve that did something


def test_chunk_sizes_agree():
    """Chunks of 16, 32 and 64 positions over 40 (3, 2 and 2 chunks, the last one partial: float64 chunks stop at
    32): the same outputs, states and gradients as the torch form (float64)."""
    ins = _inputs(40)
    for block in (16, 32, 64):
        agree(_ops().delta_rule(*ins, chunk=block), delta_chunk.delta_rule(*ins, chunk=7), ins, torch.float64)
    T = _ops().triton_delta_rule(*(t.detach() for t in ins), 64)[3]
    assert T.shape[-1] == 32


@pytest.mark.parametrize("M,E", [(70, 5), (6, 66), (65, 65)])
def test_several_feature_and_value_blocks(M, E):
    """More features and value columns than one block holds (blocks of 32: three feature blocks, ``d beta``
    summed over them, and three value blocks, the serial kernels' programs included); 17 positions, two chunks."""
    ins = _inputs(17, M=M, E=E, H=1)
    agree(_ops().delta_rule(*ins, chunk=16), delta_chunk.delta_rule(*ins, chunk=5), ins, torch.float64)


def test_float32_inputs_at_float32_tolerance():
    """float32 inputs (IEEE products, float32 state) against the torch form in float64 on the same inputs: the
    kit's float32 tolerance (atol 2e-5, rtol 1e-4; gradients 10x)."""
    ins32 = _inputs(40, torch.float32)
    ins64 = [t.detach().double().requires_grad_() for t in ins32]
    got = _ops().delta_rule(*ins32, chunk=16)
    want = delta_chunk.delta_rule(*ins64, chunk=16)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)
    for a, b in zip(grads(got, ins32), grads(want, ins64), strict=True):
        torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=1e-3)


# ------------------------------------------------------------------ deliberately broken kernels must fail
#: (what, the exact text in triton_ops.py, its broken replacement); skipping the solve's *first* row would be no
#: mutant: row 1 of ``(I + A)^{-1} - I`` is ``-A_1`` already
MUTANTS = [
    ("solve: beta K K^T with its diagonal", "strict = offs_l[:, None] > offs_l[None, :]\n    Tm",
     "strict = offs_l[:, None] >= offs_l[None, :]\n    Tm"),
    ("solve: last row skipped", "for i in range(1, BLOCK_L):", "for i in range(1, BLOCK_L - 1):"),
    ("backward: tril(Q K^T)^T without its diagonal", "PT = tl.where(offs_l[:, None] <= offs_l[None, :], PT, 0.0)",
     "PT = tl.where(offs_l[:, None] < offs_l[None, :], PT, 0.0)"),
    ("backward: dP without its diagonal", "dP = tl.where(offs_l[:, None] >= offs_l[None, :], dP, 0.0)",
     "dP = tl.where(offs_l[:, None] > offs_l[None, :], dP, 0.0)"),
    ("backward: Z with its diagonal", "Z = tl.where(offs_l[:, None] > offs_l[None, :], -Z, 0.0)",
     "Z = tl.where(offs_l[:, None] >= offs_l[None, :], -Z, 0.0)"),
    ("serial: u from the state after the chunk", "u -= tl.dot(w, S, input_precision=PREC, out_dtype=acc_t)",
     "u -= tl.dot(w, tl.load(CK + state + M * E + s_ptrs, mask=s_mask, other=0.0), input_precision=PREC, "
     "out_dtype=acc_t)"),
    ("backward: G of the state before the chunk, not after", "G = tl.load(DH + M * E + s_ptrs",
     "G = tl.load(DH + s_ptrs"),
]
_count = itertools.count()


def _mutant(tmp_path: Path, old: str, new: str):
    """A copy of ``triton_ops`` with ``old`` replaced by ``new``, imported from ``tmp_path`` (the interpreter reads
    the kernels' source from the file), its operators registered under fresh names."""
    src = Path(_ops().__file__).read_text(encoding="utf-8")
    assert src.count(old) == 1, f"mutation target not found exactly once: {old!r}"
    tag = f"mutant{next(_count)}"
    src = (src.replace(old, new).replace("from ..", "from attnkit_kernelized.")
           .replace('define("triton_delta_', f'define("{tag}_delta_'))
    path = tmp_path / f"{tag}.py"
    path.write_text(src, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"attnkit_kernelized_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("what,old,new", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_broken_kernel_fails_the_comparison(tmp_path, what, old, new):
    """Each off-by-one, planted in a copy of the module, makes the comparison of :func:`agree` (outputs, state,
    gradients against the torch form, float64, 40 positions in chunks of 16) fail; the unbroken copy passes."""
    ins = _inputs(40)
    agree(_mutant(tmp_path, old, old).delta_rule(*ins, chunk=16), delta_chunk.delta_rule(*ins, chunk=16), ins,
          torch.float64)
    broken = _mutant(tmp_path, old, new)
    with pytest.raises(AssertionError):
        agree(broken.delta_rule(*ins, chunk=16), delta_chunk.delta_rule(*ins, chunk=16), ins, torch.float64)


def test_float16_at_64_position_chunks():
    """Half inputs run 64-position chunks (``_TILES``): float16 over 70 positions (a full chunk and 6) against the
    torch form in float64 on the same rounded inputs. The state is float32 and agrees to float32 accuracy; the
    output to its own float16 rounding; the gradients (float32 inside, float16 out) to the same."""
    ins = [t.detach().to(torch.float16).requires_grad_() for t in _inputs(70, M=8, E=4)]
    out, S = _ops().delta_rule(*ins, chunk=64)
    assert out.dtype == torch.float16 and S.dtype == torch.float32
    assert _ops().triton_delta_rule(*(t.detach() for t in ins[:4]), S.detach(), 64)[3].shape[-1] == 64
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    want, S64 = delta_chunk.delta_rule(*ins64, chunk=64)
    torch.testing.assert_close(S.double(), S64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    for a, b in zip(grads([out.float(), S], ins), grads([want, S64], ins64), strict=True):
        assert a.dtype == torch.float16 and torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=1e-2 * b.abs().max().item(), rtol=1e-2)
