"""linear attention's triton operator on half-precision inputs: float32 accumulation, numerators, denominators and
states (stored in float16 they overflowed to Inf on long sums). ``triton`` mark: runs under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch
from comparisons import TRITON, grads

from attnkit_kernelized.linear import chunk as linear_chunk

pytestmark = TRITON


@pytest.mark.parametrize("causal", [True, False])
def test_linear_half_inputs_accumulate_in_float32(causal):
    """The sums of the float16 rfa case (no decay) through linear attention's triton operator: its state,
    numerator and denominator used to be stored in float16 and became Inf; now float32, finite, and the output
    and gradients agree with float64 on the same rounded inputs."""
    from attnkit_kernelized.linear import triton_ops as linear_triton

    L, M, E = 64, 4, 3
    g = torch.Generator().manual_seed(0)
    q = (torch.rand(1, 2, L, M, generator=g, dtype=torch.float64) * 20).half().requires_grad_()
    k = (torch.rand(1, 2, L, M, generator=g, dtype=torch.float64) * 20 + 10).half().requires_grad_()
    v = (torch.rand(1, 2, L, E, generator=g, dtype=torch.float64) * 100 + 50).half().requires_grad_()
    out, S, z = linear_triton.linear_attention(q, k, v, causal=causal, chunk=16)
    assert out.dtype == torch.float16 and S.dtype == torch.float32 and z.dtype == torch.float32
    assert S.abs().max() > 65504 and torch.isfinite(S).all() and torch.isfinite(out).all()
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, S64, _ = linear_chunk.linear_attention(*ins64, causal=causal, chunk=16)
    torch.testing.assert_close(S.double(), S64, atol=0, rtol=1e-5)
    torch.testing.assert_close(out.double(), want, atol=0, rtol=1e-2)
    for a, b in zip(grads([out.float()], [q, k, v]), grads([want], ins64), strict=True):
        assert a.dtype == torch.float16 and torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=1e-2 * b.abs().max().item(), rtol=2e-2)
