"""``routing``: backends against the reference, one cluster = exact, EMA centroids, commitment loss, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import proj_sum, rand

import attnkit
from attnkit import masks
from attnkit.errors import InvalidInputError, UnsupportedFeatureError
from attnkit_sparse.routing.clusters import route
from attnkit_sparse.routing.naive import pair_counts, reference

BACKENDS = ("torch", "numba")
TOL = dict(atol=1e-10, rtol=1e-9)


def _build(**kw):
    return attnkit.build("routing", num_heads=2, head_dim=8, **kw).double().eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_backends_match_reference_outputs_and_gradients(backend, causal, padded):
    B, H, L, D, E = 2, 2, 37, 8, 5
    attn = _build(num_clusters=4, seed=3, backend=backend)
    q, k, v = rand((B, H, L, D), 1), rand((B, H, L, D), 2), rand((B, H, L, E), 3)
    kpm = None
    if padded:
        kpm = torch.ones(B, L, dtype=torch.bool)
        kpm[0, -8:] = False
        kpm[1, [0, 9]] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    poisoned = list(leaves)
    if kpm is not None:
        bad = ~kpm[:, None, :, None]
        poisoned[1] = torch.where(bad, torch.full_like(k, float("nan")), leaves[1])
        poisoned[2] = torch.where(bad, torch.full_like(v, float("inf")), leaves[2])
    out = attn(*poisoned, causal=causal, key_padding_mask=kpm)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(attn, *ref_leaves, mask=masks.resolve(causal=causal, key_padding_mask=kpm))
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(torch.autograd.grad(proj_sum(out), leaves), torch.autograd.grad(proj_sum(ref), ref_leaves)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_cluster_is_exact_attention(backend, causal):
    q, k, v = rand((2, 2, 19, 8), 1), rand((2, 2, 19, 8), 2), rand((2, 2, 19, 5), 3)
    attn = _build(num_clusters=1, backend=backend)
    kpm = torch.ones(2, 19, dtype=torch.bool)
    kpm[1, 4:9] = False
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    keep = kpm[:, None, None, :] & (torch.ones(19, 19, dtype=torch.bool).tril() if causal else True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    real = kpm[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], want[real], **TOL)
    assert float(out[~real].abs().sum()) == 0.0          # padded positions are never routed (as queries either)


def test_clusters_are_balanced_and_top_w_per_centroid():
    attn = _build(num_clusters=4)
    q, k = rand((1, 2, 20, 8), 1), rand((1, 2, 20, 8), 2)
    qi, qok, ki, kok = route(q, k, attn.centroids_for(q), None)
    assert qi.shape == (1, 2, 4, 5) and bool(qok.all()) and bool(kok.all())      # w = 20 / 4 per cluster
    s = torch.einsum("bhld,hcd->bhcl", q / q.norm(dim=-1, keepdim=True), attn.centroids_for(q))
    for c in range(4):
        top = set(s[0, 0, c].topk(5).indices.tolist())
        assert set(qi[0, 0, c].tolist()) == top
    assert bool((qi[..., 1:] > qi[..., :-1]).all())                                # ascending positions


def test_causal_pairs_never_attend_the_future():
    attn = _build(num_clusters=3)
    q, k = rand((2, 2, 30, 8), 1), rand((2, 2, 30, 8), 2)
    n = pair_counts(attn, q, k, causal=True, key_padding_mask=None)
    assert int(n.triu(1).sum()) == 0 and int(n.sum()) > 0
    v = rand((2, 2, 30, 3), 4).requires_grad_()
    out = attn(q, k, v, causal=True)
    (g,) = torch.autograd.grad(out[:, :, 10].sum(), v)
    assert float(g[:, :, 11:].abs().sum()) == 0.0


def test_centroids_follow_the_data_in_training_and_are_frozen_in_eval():
    attn = _build(num_clusters=2, decay=0.5)
    q, k, v = rand((2, 2, 16, 8), 1), rand((2, 2, 16, 8), 2), rand((2, 2, 16, 8), 3)
    before = attn.centroids.clone()
    attn(q, k, v)
    assert torch.equal(attn.centroids, before)                                      # eval: frozen
    attnkit.aux_losses(attn)
    attn.train()
    x = torch.cat([q, k], 2)
    x = x / x.norm(dim=-1, keepdim=True)
    near = torch.einsum("bhld,hcd->bhlc", x, before).argmax(-1)
    attn(q, k, v)
    after = attn.centroids
    assert not torch.equal(after, before)
    torch.testing.assert_close(after.norm(dim=-1), torch.ones(2, 2, dtype=after.dtype))
    for h in range(2):
        for c in range(2):
            sel = x[:, h][near[:, h] == c]
            want = 0.5 * before[h, c] + 0.5 * sel.mean(0)
            torch.testing.assert_close(after[h, c], want / want.norm())
    losses = attnkit.aux_losses(attn, weighted=False)
    assert set(losses) == {"routing_commitment"}
    want = ((x - before[torch.arange(2)[None, :, None], near]) ** 2).sum(-1).mean()
    torch.testing.assert_close(losses["routing_commitment"], want)


def test_commitment_loss_reaches_queries_and_keys_and_is_weighted():
    attn = _build(num_clusters=2).train()
    q, k, v = (rand((1, 2, 8, 8), s).requires_grad_() for s in (1, 2, 3))
    attn(q, k, v)
    loss = attnkit.aux_losses(attn)["routing_commitment"]
    assert attnkit.get_spec("routing").aux_losses["routing_commitment"] == 1e-4
    gq, gk = torch.autograd.grad(loss, (q, k))
    assert gq.abs().sum() > 0 and gk.abs().sum() > 0


def test_more_clusters_than_tokens_route_one_token_each():
    attn = _build(num_clusters=16)
    q, k, v = rand((1, 2, 5, 8), 1), rand((1, 2, 5, 8), 2), rand((1, 2, 5, 3), 3)
    qi, qok, ki, kok = route(q, k, attn.centroids_for(q), None)
    assert qi.shape[-1] == 1
    out = attn(q, k, v)
    torch.testing.assert_close(out, reference(attn, q, k, v), **TOL)
    assert torch.isfinite(out).all()


def test_lazy_centroids_state_dict_and_layer():
    attn = attnkit.build("routing", num_clusters=3)
    assert attn.centroids is None
    attn(rand((1, 2, 6, 4), 1), rand((1, 2, 6, 4), 2), rand((1, 2, 6, 4), 3))
    assert attn.centroids.shape == (1, 3, 4)
    assert "centroids" in attn.state_dict()
    attn.train()                                     # shared centroids (no num_heads) update from every head
    before = attn.centroids.clone()
    attn(rand((1, 2, 6, 4), 4), rand((1, 2, 6, 4), 5), rand((1, 2, 6, 4), 6))
    assert not torch.equal(attn.centroids, before)
    torch.testing.assert_close(attn.centroids.norm(dim=-1), torch.ones(1, 3, dtype=before.dtype))
    mha = attnkit.MultiHeadAttention(16, 2, "routing", num_clusters=2)
    assert mha.k_proj is not None and mha.attention.centroids.shape == (2, 2, 8)
    assert mha(torch.randn(2, 9, 16), causal=True).shape == (2, 9, 16)


def test_bad_input():
    for kw, name in (({"num_clusters": 0}, "num_clusters"), ({"decay": 1.0}, "decay"), ({"seed": -1}, "seed")):
        with pytest.raises(InvalidInputError, match=name):
            attnkit.build("routing", **kw)
    attn = _build(num_clusters=2)
    q = rand((1, 2, 6, 8), 0)
    with pytest.raises(UnsupportedFeatureError):
        attn(q, rand((1, 2, 4, 8), 1), rand((1, 2, 4, 8), 2))
    with pytest.raises(InvalidInputError):
        attn(rand((1, 2, 6, 4), 0), rand((1, 2, 6, 4), 0), rand((1, 2, 6, 4), 0))   # head_dim 8 declared


def test_sync_centroids_is_a_bool_and_a_no_op_without_a_process_group():
    """Under DDP it all-reduces the EMA's cluster sums and counts (integration_tests/test_ddp_all.py checks the
    buffers equal one process's); without an initialised group the update equals the default one."""
    with pytest.raises(InvalidInputError, match="sync_centroids: expected bool, got 1"):
        attnkit.build("routing", sync_centroids=1)
    a, b = _build(num_clusters=2), _build(num_clusters=2, sync_centroids=True)
    assert "sync_centroids=True" in repr(b)
    q, k, v = rand((2, 2, 6, 8), 0), rand((2, 2, 6, 8), 1), rand((2, 2, 6, 8), 2)
    a.train()(q, k, v)
    b.train()(q, k, v)
    assert not torch.equal(a.centroids, _build(num_clusters=2).centroids)   # the EMA moved them
    assert torch.equal(a.centroids, b.centroids)
