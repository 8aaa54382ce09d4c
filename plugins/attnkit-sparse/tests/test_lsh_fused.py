"""The fused CPU kernels of ``lsh`` (:mod:`attnkit_sparse.lsh.fused`) against the plain expression, float64.

The plain expression: for each round, the chunk of every position is its sorted index ``// cs``; ``N[i, j]``
counts the rounds in which ``j`` is in ``i``'s chunk or the previous one (``j != i``, causal, not padded),
and the output is the softmax of ``scale·q_i·k̂_j + log N[i, j]`` over the pairs with ``N > 0``, 0 for a
position with none. Values and gradients, for every way the work is split into items.
"""

from __future__ import annotations

import pytest
import torch
from conftest import proj_sum, rand

from attnkit_sparse.lsh import fused
from attnkit_sparse.lsh.fused import attend_rounds

TOL = dict(atol=1e-10, rtol=1e-9)


def _perms(B, H, R, L, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(L, generator=g) for _ in range(B * H * R)]).view(B, H, R, L)


def plain(q, kh, v, perm, kpm, causal, cs, scale):
    """``(out, alone)`` by the dense count matrix (O(L²))."""
    B, H, R, L = perm.shape
    rank = perm.argsort(-1)                                              # position -> sorted index
    chunk = rank // cs
    ci, cj = chunk[..., :, None], chunk[..., None, :]
    i = torch.arange(L)
    ok = ((cj == ci) | (cj == ci - 1)) & (i[:, None] != i[None, :])      # (B, H, R, L, L)
    if causal:
        ok = ok & (i[None, :] <= i[:, None])
    if kpm is not None:
        ok = ok & kpm[:, None, None, None, :]
    n = ok.sum(2)
    has = n > 0
    s = q @ kh.transpose(-1, -2) * scale + torch.where(has, n.clamp(min=1).to(q.dtype).log(),
                                                       torch.full_like(q[..., :1], float("-inf")))
    any_ = has.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~any_, 0.0), -1).masked_fill(~has, 0.0) * any_
    return p @ v, ~any_[..., 0]


@pytest.mark.parametrize("blocks", ["auto", 1, 3])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("L,cs,R", [(23, 4, 3), (40, 8, 2), (9, 1, 2), (7, 7, 1), (30, 5, 1)])
def test_fused_rounds_match_the_plain_expression_with_gradients(blocks, threads, causal, padded, L, cs, R,
                                                                 monkeypatch):
    monkeypatch.setattr(fused, "BLOCKS", blocks)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        B, H, D, E = 2, 3, 5, 4
        q, k, v = rand((B, H, L, D), 1), rand((B, H, L, D), 2), rand((B, H, L, E), 3)
        kh = k / k.norm(dim=-1, keepdim=True)
        perm = _perms(B, H, R, L, 4)
        kpm = None
        if padded:
            kpm = torch.ones(B, L, dtype=torch.bool)
            kpm[0, -3:] = False
            kpm[1, [0, L // 2]] = False
        leaves = [t.clone().requires_grad_() for t in (q, kh, v)]
        out, alone = attend_rounds(*leaves, perm, kpm, causal=causal, chunk=cs, scale=0.7)
        ref_leaves = [t.clone().requires_grad_() for t in (q, kh, v)]
        ref, ref_alone = plain(*ref_leaves, perm, kpm, causal, cs, 0.7)
        assert torch.equal(alone, ref_alone)
        torch.testing.assert_close(out, ref, **TOL)
        grads = torch.autograd.grad(proj_sum(out), leaves)
        for a, b in zip(grads, torch.autograd.grad(proj_sum(ref), ref_leaves)):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, b, **TOL)
    finally:
        torch.set_num_threads(old)


def test_fused_rounds_float32_close_to_float64():
    B, H, L, D, R, cs = 1, 2, 200, 16, 4, 16
    q, k, v = rand((B, H, L, D), 1), rand((B, H, L, D), 2), rand((B, H, L, D), 3)
    kh = k / k.norm(dim=-1, keepdim=True)
    perm = _perms(B, H, R, L, 5)
    want, _ = attend_rounds(q, kh, v, perm, None, causal=True, chunk=cs, scale=0.25)
    got, _ = attend_rounds(q.float(), kh.float(), v.float(), perm, None, causal=True, chunk=cs, scale=0.25)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_fused_rounds_refuse_bad_input():
    q = rand((1, 1, 8, 4), 1)
    perm = _perms(1, 1, 1, 8, 0)
    with pytest.raises(ValueError, match="chunk must be an int >= 1, got 0"):
        attend_rounds(q, q, q, perm, None, causal=False, chunk=0, scale=1.0)
    with pytest.raises(ValueError, match="float32 or float64 CPU tensor, got torch.float16"):
        attend_rounds(q.half(), q.half(), q.half(), perm, None, causal=False, chunk=4, scale=1.0)
