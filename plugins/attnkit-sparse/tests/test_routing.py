"""``routing``: backends against the reference, one cluster = exact, EMA centroids, commitment loss, bad input."""

from __future__ import annotations

import numpy as np
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


@pytest.fixture(params=["fused", "engine"])
def numba_path(request, monkeypatch):
    """The numba backend's two paths: the fused kernels (:mod:`attnkit_sparse.routing.fused`) and the gathers,
    engine and combination (:mod:`attnkit_sparse.routing.gather`)."""
    import attnkit_sparse.routing.fused as fused
    monkeypatch.setattr(fused, "FUSED", request.param == "fused")
    return request.param


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("B", [2, 3])
def test_backends_match_reference_outputs_and_gradients(backend, causal, padded, B, numba_path):
    if backend == "torch" and numba_path == "engine":
        pytest.skip("one run of the torch backend is enough")
    H, L, D, E = 2, 37, 8, 5
    attn = _build(num_clusters=4, seed=3, backend=backend)
    q, k, v = rand((B, H, L, D), 1), rand((B, H, L, D), 2), rand((B, H, L, E), 3)
    kpm = None
    if padded:
        kpm = torch.ones(B, L, dtype=torch.bool)
        kpm[0, -8:] = False
        kpm[1, [0, 9]] = False
        if B > 2:
            kpm[2, 20:] = False                          # a shorter batch element: narrower clusters
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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("save", [True, False])
def test_fused_clusters_wider_than_a_query_block(causal, padded, save, monkeypatch):
    """Clusters of 75 and 66 slots run their queries in blocks of 64 against all their keys (a causal block
    skips the keys after its latest query): outputs and gradients still equal the reference's, with the
    backward reading the forward's saved probability tiles and with it computing the scores again."""
    import attnkit_sparse.routing._fused as kernels
    import attnkit_sparse.routing.fused as fused
    monkeypatch.setattr(fused, "FUSED", True)
    monkeypatch.setattr(fused, "SAVE_TILES", save)
    assert kernels.QBLOCK == 64
    B, H, L, D, E = 2, 2, 150, 8, 5
    attn = _build(num_clusters=2, seed=5, backend="numba")
    q, k, v = rand((B, H, L, D), 4), rand((B, H, L, D), 5), rand((B, H, L, E), 6)
    kpm = None
    if padded:
        kpm = torch.ones(B, L, dtype=torch.bool)
        kpm[1, 131:] = False                             # 131 real tokens: clusters of 66
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves, causal=causal, key_padding_mask=kpm)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(attn, *ref_leaves, mask=masks.resolve(causal=causal, key_padding_mask=kpm))
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(torch.autograd.grad(proj_sum(out), leaves), torch.autograd.grad(proj_sum(ref), ref_leaves)):
        torch.testing.assert_close(a, b, **TOL)


def test_fused_forward_keeps_its_tiles_only_for_a_backward_within_the_budget(monkeypatch):
    """``SAVE_TILES = "auto"``: a forward keeps its probability tiles when gradients are wanted, they fit in
    ``SAVED_MAX_BYTES`` and the process keeps freed memory; not under ``no_grad``, not for inputs without
    gradients, not over the budget, not under glibc's default allocator. The saved tiles are not changed by a
    backward: a second backward (``retain_graph``) gives the same gradients."""
    import attnkit.cpu_memory as cpu_memory
    import attnkit_sparse.routing.fused as fused
    monkeypatch.setattr(fused, "FUSED", True)
    monkeypatch.setattr(fused, "SAVE_TILES", "auto")
    monkeypatch.setattr(cpu_memory, "_kept", True)     # as after keep_freed_memory(), without changing malloc
    seen = []
    apply = fused._Fused.apply
    monkeypatch.setattr(fused._Fused, "apply", lambda *a: seen.append(a[-1]) or apply(*a))
    attn = _build(num_clusters=2, seed=5, backend="numba")
    q, k, v = rand((2, 2, 150, 8), 4), rand((2, 2, 150, 8), 5), rand((2, 2, 150, 5), 6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves, causal=True)
    with torch.no_grad():
        attn(*leaves)
    attn(q, k, v)
    assert seen == [True, False, False]
    first = torch.autograd.grad(proj_sum(out), leaves, retain_graph=True)
    again = torch.autograd.grad(proj_sum(out), leaves)
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # 2·2 sequences, 2 clusters of 75 slots: two query blocks of (76, 64) float64 tiles each
    assert fused.save_tiles(4, 2, 75, 8)
    monkeypatch.setattr(fused, "SAVED_MAX_BYTES", 4 * 2 * 2 * 76 * 64 * 8 - 1)
    attn(*leaves)
    assert seen[-1] is False
    monkeypatch.setattr(fused, "SAVED_MAX_BYTES", 1 << 30)
    monkeypatch.delenv("MALLOC_MMAP_MAX_", raising=False)
    monkeypatch.setattr(cpu_memory, "_kept", False)    # glibc's default: large blocks are fresh mmaps
    attn(*leaves)
    assert seen[-1] is False and not fused.save_tiles(4, 2, 75, 8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_cluster_is_exact_attention(backend, causal, numba_path):
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


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_checkpointed_steps_route_with_the_first_runs_centroids(backend):
    """Activation checkpointing runs the forward again during backward, after its EMA update changed the
    centroids: the recomputation routes with the centroids the first run used and updates nothing (with decay 0.5
    the updated centroids give other clusters and gradients). Two forwards before one backward: the last is
    recomputed first."""
    from torch.utils.checkpoint import checkpoint
    plain = _build(num_clusters=2, decay=0.5, backend=backend).train()
    ckpt = _build(num_clusters=2, decay=0.5, backend=backend).train()
    xs = [[rand((2, 2, 16, 8), 10 * i + s).requires_grad_() for s in (1, 2, 3)] for i in range(2)]
    runs = []
    for attn, wrap in ((plain, False), (ckpt, True)):
        outs = [checkpoint(attn, *x, use_reentrant=False) if wrap else attn(*x) for x in xs]
        loss = sum(((o * o).sum() for o in outs), torch.zeros(())) + attnkit.aux_losses(attn, weighted=False)[
            "routing_commitment"]
        loss.backward()
        runs.append([o.detach() for o in outs] + [t.grad.clone() for x in xs for t in x]
                    + [attn.centroids.clone()])
        for x in xs:
            for t in x:
                t.grad = None
        assert attn.pending_aux_losses() == {}
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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


@pytest.mark.parametrize("shared", [False, True])
def test_commitment_loss_and_ema_from_cluster_sums_equal_the_explicit_formulas_with_padding(shared):
    """The commitment term (from the per-cluster sums) and its gradient equal ``mean ‖x̂ − μ(x̂)‖²`` over the real
    queries and keys gathered explicitly; padded positions move neither the loss nor the centroids."""
    B, H, L, D, C = 2, 2, 12, 8, 3
    kw = dict(num_clusters=C, decay=0.25)
    attn = (attnkit.build("routing", head_dim=D, **kw).double() if shared else _build(**kw)).train()
    q, k, v = (rand((B, H, L, D), s) for s in (1, 2, 3))
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[0, -3:] = False
    kpm[1, 4] = False
    before = attn.centroids.clone()
    mu = before.expand(H, C, D)
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    attn(leaves[0], leaves[1], v, key_padding_mask=kpm)
    loss = attnkit.aux_losses(attn, weighted=False)["routing_commitment"]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k)]
    xs = [x / x.norm(dim=-1, keepdim=True) for x in ref_leaves]
    x = torch.cat(xs, 2)                                               # (B, H, 2L, D)
    real = torch.cat([kpm, kpm], 1)[:, None, :].expand(B, H, 2 * L)
    near = torch.einsum("bhld,hcd->bhlc", x.detach(), mu).argmax(-1)
    chosen = mu[torch.arange(H)[None, :, None], near]
    want = ((x - chosen) ** 2).sum(-1)[real].mean()
    torch.testing.assert_close(loss, want)
    for a, b in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(want, ref_leaves)):
        torch.testing.assert_close(a, b)
    # the EMA: per (head or shared, cluster) mean of the real unit vectors assigned to it
    xd = x.detach()
    for c in range(C):
        for h in range(attn.centroids.shape[0]):
            sel = (near == c) & real
            if not shared:
                sel = sel & (torch.arange(H)[None, :, None] == h)
            if not bool(sel.any()):
                torch.testing.assert_close(attn.centroids[h, c], before[h, c])
                continue
            w = 0.25 * before[h, c] + 0.75 * xd[sel].mean(0)
            torch.testing.assert_close(attn.centroids[h, c], w / w.norm())


def test_numba_routed_gather_and_combine_match_torch_with_gradients():
    """The CPU path's routed gathers and combination (:mod:`attnkit_sparse.routing.gather`) against torch formulas:
    positions routed by several clusters, by one and by none, rows that count for nothing (``-inf``)."""
    from attnkit_sparse.routing.gather import combine_routed, gather_routed
    N, L, M, E = 2, 9, 14, 3
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, L - 1, (N, M), generator=g)                 # position L - 1 is never routed
    idx[0, :3] = 2                                                     # position 2 routed three times
    x = rand((N, L, E), 1).requires_grad_()
    xs = gather_routed(x, idx)
    want = torch.stack([x[n, idx[n]] for n in range(N)])
    torch.testing.assert_close(xs, want, atol=1e-12, rtol=1e-12)
    w = rand(xs.shape, 2)
    torch.testing.assert_close(torch.autograd.grad((xs * w).sum(), x)[0], torch.autograd.grad((want * w).sum(), x)[0],
                               atol=1e-12, rtol=1e-12)
    out_s = rand((N, M, E), 3).requires_grad_()
    lse_s = rand((N, M), 4)
    lse_s[0, 1] = float("-inf")
    lse_s[1, idx[1] == idx[1, 0]] = float("-inf")                      # every row of one position: output 0
    lse_s.requires_grad_()
    out = combine_routed(out_s, lse_s, idx, L)
    ref = []
    for n in range(N):
        rows = []
        for i in range(L):
            sel = (idx[n] == i) & torch.isfinite(lse_s[n])
            if not bool(sel.any()):
                rows.append(torch.zeros(E, dtype=out_s.dtype))
                continue
            wt = torch.softmax(lse_s[n][sel], 0)
            rows.append((wt[:, None] * out_s[n][sel]).sum(0))
        ref.append(torch.stack(rows))
    ref = torch.stack(ref)
    assert float(out[0, L - 1].detach().abs().sum()) == 0.0 and float(out[1, idx[1, 0]].detach().abs().sum()) == 0.0
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    gw = rand(out.shape, 5)
    for a, b in zip(torch.autograd.grad((out * gw).sum(), (out_s, lse_s)),
                    torch.autograd.grad((ref * gw).sum(), (out_s, lse_s))):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_nearest_cluster_is_the_first_argmax():
    from attnkit_sparse.routing.clusters import _nearest
    s = rand((2, 3, 5, 700), 1)                                        # two blocks of positions per sequence
    s[0, 0, :, 3] = 1.0                                                # a tie: the first cluster
    s[1, 2, :, 9] = float("-inf")                                      # a padded position: 0
    got = _nearest(s)
    assert torch.equal(got, s.argmax(2))
    assert int(got[0, 0, 3]) == 0 and int(got[1, 2, 9]) == 0
    assert torch.equal(_nearest(s.float()), s.float().argmax(2))


def _route_both_ways(q, k, mu, kpm, monkeypatch):
    """``route(..., nearest=True)`` per sequence (True) and by torch's product (False); asserts that both give the
    same routed positions and used slots (the nearest centroids are left to the caller: arbitrary at padding)."""
    import attnkit_sparse.routing.clusters as clusters
    got = {}
    for per_seq in (True, False):
        monkeypatch.setattr(clusters, "PER_SEQUENCE", per_seq)
        got[per_seq] = route(q, k, mu, kpm, nearest=True)
    for a, b in zip(got[True][:4], got[False][:4]):
        assert torch.equal(a, b)
    return got


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(2, 2, 37, 4, 2), (1, 3, 3000, 24, 1)])   # (B, H, L, clusters, centroid heads)
def test_route_per_sequence_equals_the_product_path(dtype, shape, monkeypatch):
    """The per-sequence routing kernel (scores on register panels tile by tile, nearest centroids, selection:
    :func:`route_seq`) routes exactly as torch's product over all sequences followed by the nearest-centroid and
    top-w kernels: the same positions and used slots, the same nearest centroid at every real position, with
    padding (NaN keys there), a NaN query at a real position (nearest 0, never routed), a duplicated centroid
    (tied scores: the first cluster is nearest), lengths not a multiple of the score tile and shared or per-head
    centroids."""
    import attnkit_sparse.routing.clusters as clusters
    from attnkit_sparse.routing._numba import TILE
    B, H, L, C, hc = shape
    assert L % TILE
    g = torch.Generator().manual_seed(L)
    q = torch.randn(B, H, L, 8, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H, L, 8, generator=g, dtype=torch.float64).to(dtype)
    mu = clusters.unit(torch.randn(hc, C, 8, generator=g, dtype=torch.float64)).to(dtype)
    mu[:, 2] = mu[:, 1]                                                  # tied scores: cluster 1 is nearest
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[0, -5:] = False
    k[0, :, -5:] = float("nan")
    q[-1, -1, 7] = float("nan")
    got = _route_both_ways(q, k, mu, kpm, monkeypatch)
    for a, b in zip(got[True][4], got[False][4]):
        assert torch.equal(a[:, :, :-5], b[:, :, :-5]) and torch.equal(a[1:], b[1:])
    near_q = got[True][4][0]
    assert int(near_q[-1, -1, 7]) == 0
    assert not (got[True][0][-1, -1] == 7)[got[True][1][-1, -1]].any()   # the NaN query is never routed
    assert not (near_q == 2).any() and (near_q == 1).any()               # ties go to the first cluster


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_route_per_sequence_long_rows_never_write_scores(dtype, monkeypatch):
    """Rows long enough for the sampled threshold: :func:`route_seq` keeps each tile's candidates and writes no
    scores (it is handed a scores buffer without columns, and would raise on the short-row path), and still
    routes exactly as the product path. Batch element 1 has every sample position padded (NaN keys there), so
    none of its clusters gets a threshold and each is scored again over its whole row (the fallback); element
    0 has a NaN query and shared centroids with a duplicate (ties)."""
    import attnkit_sparse.routing.clusters as clusters
    from attnkit_sparse.routing._numba import TILE
    B, H, L, C, D = 2, 2, 4000, 64, 8
    assert L % TILE
    st = L // 512
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, H, L, D, generator=g, dtype=torch.float64).to(dtype)
    mu = clusters.unit(torch.randn(1, C, D, generator=g, dtype=torch.float64)).to(dtype)
    mu[:, 2] = mu[:, 1]
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, ::st] = False                                                # every sample position of element 1
    k[1, :, ::st] = float("nan")
    q[0, 1, 11] = float("nan")
    n = kpm.sum(-1)
    widths = torch.tensor([clusters.cluster_width(int(x), C) for x in n.tolist()])
    assert not clusters._writes_scores(widths.numpy(), int(widths.max()), L)   # no buffer: the long-row path
    got = _route_both_ways(q, k, mu, kpm, monkeypatch)
    for a, b in zip(got[True][4], got[False][4]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1][:, kpm[1]], b[1][:, kpm[1]])
    k_idx, k_ok = got[True][2], got[True][3]
    assert k_ok[1].any() and not (k_idx[1][k_ok[1]] % st == 0).any()     # padded keys never routed
    assert not (got[True][0][0, 1] == 11)[got[True][1][0, 1]].any()     # the NaN query is never routed


def _top_w_torch(s, inv, real, H, widths, W):
    """The plain torch expression of :func:`top_w_ascending`: masked scaled scores, ``topk``, ascending positions."""
    N, C, L = s.shape
    B = N // H
    x = s * inv[:, None, :]
    keep = real.repeat(B // real.shape[0], 1).repeat_interleave(H, 0)[:, None, :] & ~torch.isnan(x)
    x = torch.where(keep, x, torch.full_like(x, float("-inf")))
    w = widths.repeat_interleave(H).view(N, 1, 1)
    val, idx = x.topk(W, -1)
    ok = (torch.arange(W) < w) & (val > float("-inf"))
    idx = torch.where(ok, idx, torch.full_like(idx, L)).sort(-1).values
    ok = idx < L
    return torch.where(ok, idx, torch.zeros_like(idx)), ok, x


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L", [37, 5000])        # 5000: the sampled-threshold path; 37: the whole-row partition
def test_top_w_kernel_equals_topk_with_padding_nan_and_ties(dtype, L):
    """The routing kernel's top-w per cluster, ascending, against ``topk`` + ``sort``: padded positions and NaN
    never routed, a batch element with fewer real positions than its width, unused slots position 0 and not ok;
    with ties (integer scores), the routed values are the top-w values and ties go to the lowest positions."""
    from attnkit.numba_pool import run_ranges
    from attnkit_sparse.routing._numba import top_w_ascending

    def top_w(s, inv, real, H, widths, W):   # as routing runs it: ranges of sequences on two threads
        N, C, _ = s.shape
        idx, ok = np.zeros((N, C, W), dtype=np.int64), np.zeros((N, C, W), dtype=np.bool_)
        run_ranges(top_w_ascending, N * -(-C // 8), s, inv, real, H, widths, W, idx, ok, threads=2)
        return idx, ok

    H, C, W = 2, 3, 16
    s = torch.randn(2 * H, C, L, dtype=torch.float64, generator=torch.Generator().manual_seed(L)).to(dtype)
    s[0, 1, 5] = float("nan")
    inv = torch.rand(2 * H, L, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
    real = torch.ones(2, L, dtype=torch.bool)
    real[1, L // 2:] = False
    real[1, :3] = False
    widths = torch.tensor([W, 5])
    idx, ok = top_w(s.numpy(), inv.numpy(), real.numpy(), H, widths.numpy(), W)
    want_i, want_ok, _ = _top_w_torch(s, inv, real, H, widths, W)
    assert torch.equal(torch.from_numpy(ok), want_ok)
    assert torch.equal(torch.from_numpy(idx), want_i)
    # ties: integer scores, so the w-th value is shared by many positions
    t = torch.randint(0, 6, (2 * H, C, L), generator=torch.Generator().manual_seed(3)).to(dtype)
    one = torch.ones(2 * H, L, dtype=dtype)
    idx, ok = top_w(t.numpy(), one.numpy(), real.numpy(), H, widths.numpy(), W)
    idx, ok = torch.from_numpy(idx), torch.from_numpy(ok)
    _, want_ok, x = _top_w_torch(t, one, real, H, widths, W)
    assert torch.equal(ok, want_ok)
    for n in range(2 * H):
        for c in range(C):
            sel = idx[n, c][ok[n, c]]
            assert torch.all(sel[1:] > sel[:-1])                                # ascending, distinct
            got_v = x[n, c, sel].sort(descending=True).values
            want_v = x[n, c].topk(int(ok[n, c].sum())).values
            assert torch.equal(got_v, want_v)                                  # a top-w set
            thr = got_v[-1]
            ties = (x[n, c] == thr).nonzero().flatten()
            taken = sel[x[n, c, sel] == thr]
            assert torch.equal(taken, ties[:len(taken)])                       # ties: the lowest positions


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_selection_parts_against_numpy(dtype):
    """The parts of the top-w selection: the vector compare's bit mask (:func:`._mask_bits.ge_bits`) equals the
    scalar test lane by lane (NaN, inf, ties at the threshold, float32 and float64 lanes); the sample's k-th
    largest through the insertion buffer and past it, and the candidates' quickselect (plain and through a
    histogram), equal ``np.partition``'s value with repeated values, for every rank."""
    import numba

    from attnkit_sparse.routing._mask_bits import ge_bits
    from attnkit_sparse.routing._numba import _SMALL_RANK, _kth_largest, _select_largest, _select_largest_bucketed

    @numba.njit
    def bits_at(row, sc, j, t):
        return ge_bits(row, sc, j, t)

    rng = np.random.default_rng(0)
    row = rng.integers(-3, 4, 64).astype(dtype)                 # ties at every threshold
    sc = rng.choice(np.array([0.5, 1.0, 2.0], dtype=dtype), 64)
    row[[3, 17]] = np.nan
    row[5], sc[9] = np.inf, np.inf
    lanes = 8 if dtype == np.float32 else 4
    for t in (-2.0, 0.0, 1.0, 3.0, np.inf):
        for j in range(0, 64 - lanes + 1, lanes):
            want = sum(1 << i for i in range(lanes) if row[j + i] * sc[j + i] >= t)
            assert bits_at(row, sc, j, t) == want
    buf = np.empty(_SMALL_RANK, dtype=dtype)
    work = np.empty(300, dtype=dtype)
    for n in (1, 2, 7, 40, 300):
        a = rng.integers(0, 5 if n > 2 else 2, n).astype(dtype)
        a[0] = -np.inf
        for k in sorted({1, min(n, 2), n // 2 + 1, min(n, _SMALL_RANK), min(n, _SMALL_RANK + 1), n}):
            want = np.partition(a, n - k)[n - k]
            assert _kth_largest(a, k, buf) == want
            before = a.copy()
            assert _select_largest(a, n, k, work) == want
            assert np.array_equal(a, before)                        # the candidates' values are kept
            assert _select_largest_bucketed(a, n, k, work) == want
            assert np.array_equal(a, before)
    # the bucketed form on what its histogram could get wrong: values on bucket edges, all equal, clustered,
    # a tiny spread (subnormal), spreads that overflow, infinities; every rank
    tiny = np.finfo(dtype).tiny
    big = np.finfo(dtype).max
    n = 300
    work = np.empty(n, dtype=dtype)
    cases = [rng.standard_normal(n), rng.integers(0, 3, n), np.full(n, 1.5), np.linspace(0.0, 255.0, n),
             np.r_[np.zeros(n - 1), 1.0], np.r_[rng.standard_normal(n - 2) * 1e-3, 10.0, -10.0],
             rng.integers(0, 4, n) * tiny, np.r_[rng.standard_normal(n - 2), big, -big],
             np.r_[rng.standard_normal(n - 2), np.inf, 0.5], np.r_[rng.standard_normal(n - 2), -np.inf, 0.5]]
    for a in cases:
        a = np.asarray(a, dtype=dtype)
        for k in range(1, n + 1):
            assert _select_largest_bucketed(a, n, k, work) == np.partition(a, n - k)[n - k], (a[:4], k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_select_row_candidate_capacity_boundary(dtype):
    """:func:`select_row`'s candidate pass at the edge of its buffer: a row built so that the sample's threshold
    admits exactly ``cap - 1``, ``cap``, ``cap + 1`` and ``cap + 40`` candidates (the last two: the whole-row
    fallback), on a contiguous row and on a strided one (no vector compare), always the positions ``topk``
    gives (ties at the w-th value: the lowest positions). The largest values lie at the last candidates, so a
    pass that stopped early and kept what it had would miss them."""
    from attnkit_sparse.routing._numba import _SMALL_RANK, CAND_SLACK, sample_rank, select_row
    w, st = 8, 16
    cap = 8 * w + 64
    L = 4 * cap + 77                                   # above 4·cap: the sampled path; not a multiple of 32
    ms = (L + st - 1) // st
    k = sample_rank(w, st)
    for extra in (cap - 1, cap, cap + 1, cap + 40):
        row = np.zeros(L, dtype=dtype)
        row[np.arange(k) * st] = 1.0                   # the sample's k-th largest: 1.0
        free = np.setdiff1d(np.arange(L), np.arange(ms) * st)
        hot = np.sort(np.random.default_rng(extra).choice(free, extra - k, replace=False))
        row[hot] = 1.0 + np.arange(extra - k) // 2     # candidates (>= 1.0): the largest last, in tied pairs
        for strided in (False, True):
            r = np.repeat(row, 2)[::2] if strided else row
            assert (r.strides[0] != r.itemsize) == strided
            iv = np.ones(L, dtype=dtype)
            iv[hot[-1]] = np.nan                       # a padded candidate (NaN scale): never routed
            out_i, out_ok = np.zeros(w, dtype=np.int64), np.zeros(w, dtype=np.bool_)
            select_row(r, iv, w, st, np.empty(L, dtype=dtype), np.empty(ms, dtype=dtype),
                       np.empty(_SMALL_RANK, dtype=dtype), np.empty(cap + CAND_SLACK, dtype=np.int64),
                       np.empty(cap + CAND_SLACK, dtype=dtype), out_i, out_ok)
            x = torch.from_numpy(np.where(np.isnan(iv), -np.inf, row * iv))
            top = x.topk(w).values
            thr = top[-1]
            above = (x > thr).nonzero().flatten()
            ties = (x == thr).nonzero().flatten()[: w - len(above)]
            want = torch.cat([above, ties]).sort().values
            assert out_ok.all()
            assert torch.equal(torch.from_numpy(out_i), want), (extra, strided)


@pytest.mark.parametrize("padded", [False, True])
def test_numba_commitment_equals_the_index_add_form_with_gradients(padded):
    """The CPU commitment term (:func:`attnkit_sparse.routing.gather.commitment`: sums, counts, value and gradient)
    against the ``index_add`` form the module runs on other devices, float64, with a zero row (norm below the
    floor) and padded positions."""
    from attnkit_sparse.routing.attention import RoutingAttention
    from attnkit_sparse.routing.gather import commitment
    B, H, L, D, C = 2, 3, 11, 6, 4
    q, k = rand((B, H, L, D), 1), rand((B, H, L, D), 2)
    q[1, 2, 3] = 0.0
    mu = torch.nn.functional.normalize(rand((H, C, D), 3), dim=-1)
    g = torch.Generator().manual_seed(4)
    near = (torch.randint(0, C, (B, H, L), generator=g), torch.randint(0, C, (B, H, L), generator=g))
    kpm = None
    if padded:
        kpm = torch.ones(B, L, dtype=torch.bool)
        kpm[0, -4:] = False
        kpm[1, 0] = False
    a = [t.clone().requires_grad_() for t in (q, k)]
    b = [t.clone().requires_grad_() for t in (q, k)]
    got = commitment(a[0], a[1], near, kpm, mu)
    want = RoutingAttention._commitment_torch(b[0], b[1], kpm, near, mu)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)
    for x, y in zip(torch.autograd.grad(got[0] * 0.7, a), torch.autograd.grad(want[0] * 0.7, b)):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)
