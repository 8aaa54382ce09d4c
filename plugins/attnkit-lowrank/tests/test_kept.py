"""``attnkit_lowrank.kept``: the pooled buffers softmax_attend keeps its probability blocks in. A buffer goes
back to the pool when its graph is freed and is taken again by the next forward; graphs alive at the same time
never share one (their gradients stay right), and retain_graph backwards read their own blocks."""

from __future__ import annotations

import attnkit_lowrank.common as common
import attnkit_lowrank.kept as kept
import pytest
import torch
from attnkit_lowrank.common import softmax_attend

F64 = torch.float64


@pytest.fixture(autouse=True)
def empty_pool(monkeypatch):
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 64 * 5)
    kept.release_kept()
    yield
    kept.release_kept()


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 150, 4, generator=g, dtype=F64, requires_grad=True)
    kt = torch.randn(2, 3, 4, 5, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(2, 3, 5, 6, generator=g, dtype=F64, requires_grad=True)
    return q, kt, v


def _plain_grads(q, kt, v):
    return torch.autograd.grad((torch.softmax(q @ kt, -1) @ v).square().sum(), (q, kt, v))


def test_a_freed_graph_gives_its_buffer_back_and_the_next_forward_takes_it():
    q, kt, v = _inputs(0)
    out = softmax_attend(q, kt, v)
    ptr = out.grad_fn.kept.buf.data_ptr()
    out.sum().backward()
    del out
    assert [b.data_ptr() for b in kept._free] == [ptr]
    out2 = softmax_attend(q, kt, v)
    assert out2.grad_fn.kept.buf.data_ptr() == ptr and kept._free == []


def test_graphs_alive_together_do_not_share_and_retain_graph_reads_its_own_blocks():
    graphs = []
    for seed in (1, 2):
        q, kt, v = _inputs(seed)
        graphs.append(((q, kt, v), softmax_attend(q, kt, v)))
    assert graphs[0][1].grad_fn.kept.buf.data_ptr() != graphs[1][1].grad_fn.kept.buf.data_ptr()
    for _ in range(2):                                                # twice: retain_graph
        for inputs, out in reversed(graphs):
            got = torch.autograd.grad(out.square().sum(), inputs, retain_graph=True)
            for a, b in zip(got, _plain_grads(*inputs)):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_the_pool_keeps_at_most_its_cap(monkeypatch):
    monkeypatch.setattr(kept, "POOL_MAX_BYTES", 3 * 8 * 1000)
    bufs = [kept.KeptBuffer(1000, F64, torch.device("cpu")) for _ in range(5)]
    del bufs
    assert len(kept._free) == 3
    with pytest.raises(ValueError, match="shape"):
        kept.KeptBuffer(10, F64, torch.device("cpu")).next((4, 3))
