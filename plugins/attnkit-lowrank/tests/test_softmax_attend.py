"""``softmax_attend`` (chunked ``softmax(q kt) v`` with its own backward; linformer, nystrom, luna, isab, mca)
against autograd through the plain expression in float64: several chunks (the last one short), head views
of a (B, L, H·D) tensor, ``kt`` / ``v`` broadcast over the batch and heads, gradients asked of a subset of the
inputs, an expanded output gradient, gradcheck."""

from __future__ import annotations

import attnkit_lowrank.common as common
import pytest
import torch
from attnkit_lowrank.common import softmax_attend

F64 = torch.float64


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 64 * 5)       # 64 rows per chunk at m = 5


def _plain(q, kt, v):
    return torch.softmax(q @ kt, -1) @ v


@pytest.mark.parametrize("layout", ["contiguous", "head views", "broadcast kt v"])
def test_values_and_gradients(layout):
    g = torch.Generator().manual_seed(0)
    L = 150                                                        # chunks of 64, 64, 22
    if layout == "head views":
        x = torch.randn(2, L, 3 * 4, generator=g, dtype=F64, requires_grad=True)
        q = x.view(2, L, 3, 4).transpose(1, 2)
    else:
        x = q = torch.randn(2, 3, L, 4, generator=g, dtype=F64, requires_grad=True)
    lead = (1, 1) if layout == "broadcast kt v" else (2, 3)
    kt = torch.randn(*lead, 4, 5, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(*lead, 5, 3, generator=g, dtype=F64, requires_grad=True)
    out, ref = softmax_attend(q, kt, v), _plain(q, kt, v)
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-11)
    w = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, kt, v), w, retain_graph=True),
                    torch.autograd.grad(ref, (x, kt, v), w, retain_graph=True)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    # a subset of the inputs, and the expanded gradient of .sum()
    for sub in ((kt,), (v,), (x, v)):
        for a, b in zip(torch.autograd.grad(out.sum(), sub, retain_graph=True),
                        torch.autograd.grad(ref.sum(), sub, retain_graph=True)):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 70, 3, generator=g, dtype=F64, requires_grad=True)
    kt = torch.randn(1, 2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(1, 2, 5, 2, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(softmax_attend, (q, kt, v))


def test_layouts():
    """The output is laid out as (B, L, H, E) (the head merge after it is a view); dq as q."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 150, 3 * 4, generator=g, dtype=F64, requires_grad=True)
    q = x.view(2, 150, 3, 4).transpose(1, 2)
    kt = torch.randn(2, 3, 4, 5, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(2, 3, 5, 6, generator=g, dtype=F64, requires_grad=True)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out = softmax_attend(q, kt, v)
        assert out.shape == (2, 3, 150, 6) and out.transpose(1, 2).is_contiguous()
    dq, = torch.autograd.grad(softmax_attend(q, kt, v).sum(), q)
    assert dq.stride() == q.stride()
