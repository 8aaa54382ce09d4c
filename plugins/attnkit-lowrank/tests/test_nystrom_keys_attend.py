"""``nystrom``'s ``keys_attend`` (``softmax(Q~ K^T) V`` with its own backward) against autograd through
``masked_fill`` + ``softmax`` in float64: values and gradients with no padding, padding, a row of only
padded keys, and gradcheck."""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank.nystrom.module import keys_attend

F64 = torch.float64


def _plain(q_l, k, v, keep):
    s = q_l @ k.transpose(-1, -2)
    if keep is not None:
        s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("padding", ["none", "some", "a row all padded"])
def test_values_and_gradients_equal_masked_softmax(padding):
    g = torch.Generator().manual_seed(0)
    q_l = torch.randn(2, 3, 4, 5, generator=g, dtype=F64).requires_grad_(True)
    k = torch.randn(2, 3, 11, 5, generator=g, dtype=F64).requires_grad_(True)
    v = torch.randn(2, 3, 11, 6, generator=g, dtype=F64).requires_grad_(True)
    keep = None
    if padding != "none":
        keep = torch.ones(2, 11, dtype=torch.bool)
        keep[0, 7:] = False
        keep[1, :3] = False
        if padding == "a row all padded":
            keep[1] = False
    out, ref = keys_attend(q_l, k, v, keep), _plain(q_l, k, v, keep)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    assert torch.isfinite(out).all()
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q_l, k, v), w, retain_graph=True),
                    torch.autograd.grad(ref, (q_l, k, v), w)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    if keep is not None and padding == "some":
        # a padded key gets no weight, so no gradient through its value
        dv, = torch.autograd.grad(out, v, w)
        assert (dv[0, :, 7:] == 0).all() and (dv[1, :, :3] == 0).all()


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    q_l, k = (torch.randn(1, 2, n, 3, generator=g, dtype=F64).requires_grad_(True) for n in (3, 7))
    v = torch.randn(1, 2, 7, 4, generator=g, dtype=F64).requires_grad_(True)
    keep = torch.tensor([[True, True, False, True, True, True, False]])
    assert torch.autograd.gradcheck(lambda a, b, c: keys_attend(a, b, c, keep), (q_l, k, v))
