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


@pytest.mark.parametrize("padding", ["none", "some", "leading chunks all padded", "a row all padded"])
def test_the_streamed_no_grad_form_equals_masked_softmax(monkeypatch, padding):
    """Without a backward, key chunks with a running max (online softmax): chunks of 64 keys at m = 4."""
    import attnkit_lowrank.common as common
    import attnkit_lowrank.nystrom.module as nmod
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 64 * 4)
    calls = []
    real = nmod._keys_attend_streamed
    monkeypatch.setattr(nmod, "_keys_attend_streamed", lambda *a: calls.append(a[-1]) or real(*a))
    g = torch.Generator().manual_seed(2)
    q_l = torch.randn(2, 3, 4, 5, generator=g, dtype=F64) * 2
    k = torch.randn(2, 3, 200, 5, generator=g, dtype=F64)
    v = torch.randn(2, 3, 200, 6, generator=g, dtype=F64)
    keep = None
    if padding != "none":
        keep = torch.ones(2, 200, dtype=torch.bool)
        keep[0, 150:] = False
        if padding == "leading chunks all padded":
            keep[1, :140] = False                 # the running max starts at the dtype's minimum
        if padding == "a row all padded":
            keep[1] = False
    with torch.no_grad():
        out = keys_attend(q_l, k, v, keep)
    assert calls == [64]
    torch.testing.assert_close(out, _plain(q_l, k, v, keep), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("padding", ["none", "some", "leading chunks all padded", "a row all padded"])
def test_the_chunked_backward_equals_masked_softmax(monkeypatch, padding):
    """Key chunks of 64 at m = 4 (the last one short) with a backward: values and gradients of head views of
    (B, S, H·D) tensors, in that layout, against autograd through masked_fill + softmax."""
    import attnkit_lowrank.common as common
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 64 * 4)
    g = torch.Generator().manual_seed(4)
    B, H, S, D, E = 2, 3, 200, 5, 6
    q_l = (torch.randn(B, H, 4, D, generator=g, dtype=F64) * 2).requires_grad_(True)
    kx = torch.randn(B, S, H * D, generator=g, dtype=F64, requires_grad=True)
    vx = torch.randn(B, S, H * E, generator=g, dtype=F64, requires_grad=True)
    k, v = kx.view(B, S, H, D).transpose(1, 2), vx.view(B, S, H, E).transpose(1, 2)
    keep = None
    if padding != "none":
        keep = torch.ones(B, S, dtype=torch.bool)
        keep[0, 150:] = False
        if padding == "leading chunks all padded":
            keep[1, :140] = False
        if padding == "a row all padded":
            keep[1] = False
    out, ref = keys_attend(q_l, k, v, keep), _plain(q_l, k, v, keep)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q_l, kx, vx), w, retain_graph=True),
                    torch.autograd.grad(ref, (q_l, kx, vx), w)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    # a subset of the inputs
    for sub in ((q_l,), (vx,), (kx, vx)):
        for a, b in zip(torch.autograd.grad(out.sum(), sub, retain_graph=True),
                        torch.autograd.grad(_plain(q_l, k, v, keep).sum(), sub)):
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_key_gradients_keep_the_head_view_layout():
    """dK and dV come back laid out as the head views they are taken of, so the head split's backward is a view."""
    q_l = torch.randn(1, 2, 3, 4, dtype=F64, requires_grad=True)
    k = torch.randn(1, 50, 2 * 4, dtype=F64).view(1, 50, 2, 4).transpose(1, 2).requires_grad_(True)
    v = torch.randn(1, 50, 2 * 4, dtype=F64).view(1, 50, 2, 4).transpose(1, 2).requires_grad_(True)
    _, dk, dv = torch.autograd.grad(keys_attend(q_l, k, v, None).sum(), (q_l, k, v))
    assert dk.stride() == k.stride() and dv.stride() == v.stride()
