"""``linformer`` at S = max_length uses its projections whole (no slice, whose backward zero-filled a
parameter-sized gradient); at S < max_length the slice. Both: outputs and gradients of q, k, v, E and F
equal the plain reference's in float64, and the columns beyond S get zero gradient."""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank.linformer.naive import reference

import attnkit

F64 = torch.float64


@pytest.mark.parametrize("S", [12, 9])
@pytest.mark.parametrize("share_kv", [False, True])
def test_gradients_of_the_projections_at_and_below_max_length(S, share_kv):
    torch.manual_seed(0)
    attn = attnkit.build("linformer", proj_len=5, max_length=12, share_kv=share_kv).double()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, S, 4, generator=g, dtype=F64).requires_grad_(True) for _ in range(3))
    params = [p for p in (attn.proj_k, attn.proj_v) if p is not None]
    out, ref = attn(q, k, v), reference(attn, q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, *params], w)
    want = torch.autograd.grad(ref, [q, k, v, *params], w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    for grad in got[3:]:
        assert grad.shape == (1, 5, 12)
        assert grad[..., :S].abs().sum() > 0
        assert (grad[..., S:] == 0).all()
