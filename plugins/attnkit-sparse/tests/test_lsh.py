"""``lsh``: backends against the reference, the paper's rules, the engine's explicit plans (float64, tiny shapes)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import proj_sum, rand

import attnkit
from attnkit import masks
from attnkit.errors import InvalidInputError, UnsupportedFeatureError
from attnkit_sparse import engine
from attnkit_sparse.engine import attend_plan, explicit_plan, reference_attend
from attnkit_sparse.lsh.naive import pair_counts, reference

BACKENDS = ("torch", "numba")
TOL = dict(atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_backends_match_reference_outputs_and_gradients(backend, causal, padded):
    B, H, L, D, E = 2, 2, 45, 8, 6
    attn = attnkit.build("lsh", bucket_size=4, n_hashes=3, seed=7, backend=backend)
    q, k, v = rand((B, H, L, D), 1), rand((B, H, L, D), 2), rand((B, H, L, E), 3)
    kpm = None
    if padded:
        kpm = torch.ones(B, L, dtype=torch.bool)
        kpm[0, -9:] = False
        kpm[1, [0, 5, 17]] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    poisoned = list(leaves)
    if kpm is not None:  # padded keys hold NaN / Inf: no influence
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


def _exact_shared_qk(q, v, scale, causal):
    """Softmax of scale·q_i·q̂_j over j != i (j <= i when causal); itself when it has nothing else."""
    L = q.shape[2]
    k = q / q.norm(dim=-1, keepdim=True)
    s = q @ k.transpose(-1, -2) * scale
    allowed = ~torch.eye(L, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(L, L, dtype=torch.bool).tril()
    out = torch.softmax(s.masked_fill(~allowed, float("-inf")).masked_fill(~allowed.any(-1, keepdim=True), 0), -1)
    out = out.masked_fill(~allowed, 0) @ v
    alone = ~allowed.any(-1)
    return torch.where(alone[:, None], v, out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_bucket_is_exact_shared_qk_attention_with_the_self_rule(backend, causal):
    q, v = rand((1, 2, 13, 8), 11), rand((1, 2, 13, 5), 12)
    for bucket_size, n_hashes in ((13, 1), (64, 3)):   # L <= bucket_size: one bucket, one chunk
        attn = attnkit.build("lsh", bucket_size=bucket_size, n_hashes=n_hashes, backend=backend)
        out = attn(q, q, v, causal=causal)
        torch.testing.assert_close(out, _exact_shared_qk(q, v, 1 / math.sqrt(8), causal), **TOL)


def test_reproducible_from_seed_and_seeds_differ():
    k = rand((1, 2, 64, 8), 3)
    a, b, c = (attnkit.build("lsh", bucket_size=4, n_hashes=2, seed=s) for s in (5, 5, 6))
    pa, pb, pc = (m.sorted_rounds(k) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.equal(pa, pc)
    # the rounds differ from one another (independent rotations)
    assert not torch.equal(pa[:, :, 0], pa[:, :, 1])
    # a rebuilt module (pickled) hashes the same
    import pickle
    assert torch.equal(pickle.loads(pickle.dumps(a)).sorted_rounds(k), pa)


def test_hashes_are_argmax_of_the_rotated_projection():
    from attnkit_sparse.lsh.hashing import buckets, n_buckets, rotations
    assert (n_buckets(8, 8), n_buckets(9, 8), n_buckets(17, 8), n_buckets(24, 8)) == (1, 2, 4, 4)
    x = rand((1, 1, 30, 4), 2)
    rot = rotations(0, 2, 4, 2, dtype=torch.float64, device=torch.device("cpu"))
    got = buckets(x, rot, 8, torch.tensor([30]))                     # 4 buckets: 2 columns
    proj = torch.einsum("ld,rdn->rln", x[0, 0], rot)
    want = torch.cat([proj, -proj], -1).argmax(-1)
    assert torch.equal(got[0, 0], want)
    assert set(got.unique().tolist()) <= {0, 1, 2, 3}


def test_causal_pairs_never_attend_the_future_and_never_self_unless_alone():
    k = rand((2, 2, 40, 8), 4)
    attn = attnkit.build("lsh", bucket_size=4, n_hashes=4, seed=1)
    for causal in (False, True):
        n = pair_counts(attn, k, causal=causal, key_padding_mask=None)
        assert int(n.diagonal(dim1=-2, dim2=-1).sum()) == 0
        if causal:
            assert int(n.triu(1).sum()) == 0
        assert int(n.sum()) > 0
    # through the module: d out_i / d v_j is zero for j > i (causal), and for j = i when i has other keys
    v = rand((1, 1, 40, 3), 5).requires_grad_()
    q = k[:1, :1]
    out = attn(q, q, v, causal=True)
    n = pair_counts(attn, q, causal=True, key_padding_mask=None)[0, 0]
    for i in (3, 20, 39):
        (g,) = torch.autograd.grad(out[0, 0, i].sum(), v, retain_graph=True)
        touched = g[0, 0].abs().sum(-1) > 0
        assert not bool(touched[i + 1:].any())
        assert bool(touched[i]) == (int(n[i].sum()) == 0)   # itself only when it has nothing else
        others = touched.clone()
        others[i] = False
        assert torch.equal(others, n[i] > 0)                 # exactly the counted pairs


def test_engine_runs_only_the_chunk_tiles(monkeypatch):
    seen = {}
    real = engine.attend_plan

    def spy(q, k, v, plan, **kw):
        seen["plan"] = plan
        return real(q, k, v, plan, **kw)

    monkeypatch.setattr(engine, "attend_plan", spy)
    B, H, L, R, cs = 1, 2, 64, 3, 8
    attn = attnkit.build("lsh", bucket_size=cs, n_hashes=R, backend="torch")   # numba: the fused path, no plan
    q = rand((B, H, L, 4), 1)
    nq = L // cs
    attn(q, q, q, causal=True)                            # causal: each head and round has its own masks
    p = seen["plan"]
    assert p.index_dims == (B, H * R)
    assert p.tiles == B * H * R * (2 * nq - 1)            # its chunk and the previous one: linear in L
    assert p.attended_pairs <= B * H * R * L * 2 * cs
    assert p.bank.shape == (B * H * R * nq * 2, cs, cs)   # one entry per (chunk, slot): an unused one for chunk 0
    attn(q, q, q)                                         # bidirectional, unpadded: one bank for every head and round
    p = seen["plan"]
    assert p.index_dims == (1, 1)
    assert p.tiles == 2 * nq - 1
    assert p.bank.shape == (nq * 2, cs, cs)


@pytest.mark.parametrize("L", [64, 61, 8, 5])
def test_shared_plan_equals_every_rounds_own_masks(L):
    """Without causal or padding the "not itself" masks of every round are the same bank: the cached shared plan
    must equal the per-round masks built from the sorted positions (short last chunk included)."""
    from attnkit_sparse.lsh.attention import chunk_masks_torch
    cs = 8
    attn = attnkit.build("lsh", bucket_size=cs, n_hashes=3, seed=2)
    perm = attn.sorted_rounds(rand((2, 2, L, 4), 3))
    cs = min(cs, L)
    want = chunk_masks_torch(perm, None, cs, False)                 # (B, H, R, NQ, 2, cs, cs)
    shared = attn._shared_plan(L, cs, torch.device("cpu"))
    nq = -(-L // cs)
    got = shared.bank.view(nq, 2, cs, cs)
    assert torch.equal(want, got.expand_as(want))
    assert shared.attended_pairs == int(want[0, 0, 0].sum()) > 0
    assert attn._shared_plan(L, cs, torch.device("cpu")) is shared  # cached


def test_multi_head_attention_builds_no_key_projection():
    mha = attnkit.MultiHeadAttention(16, 2, "lsh", bucket_size=4, n_hashes=2)
    assert mha.k_proj is None
    x = torch.randn(2, 20, 16)
    y = mha(x, causal=True)
    assert y.shape == (2, 20, 16) and torch.isfinite(y).all()
    y.sum().backward()
    assert mha.q_proj.weight.grad is not None and mha.q_proj.weight.grad.abs().sum() > 0


def test_bad_input():
    with pytest.raises(InvalidInputError, match="bucket_size"):
        attnkit.build("lsh", bucket_size=0)
    with pytest.raises(InvalidInputError, match="n_hashes"):
        attnkit.build("lsh", n_hashes=0)
    with pytest.raises(InvalidInputError, match="seed"):
        attnkit.build("lsh", seed=-1)
    with pytest.raises(InvalidInputError, match="backend"):
        attnkit.build("lsh", backend="flex")
    attn = attnkit.build("lsh", bucket_size=4)
    q = rand((1, 1, 9, 4), 0)
    with pytest.raises(UnsupportedFeatureError):
        attn(q, rand((1, 1, 7, 4), 1), rand((1, 1, 7, 4), 2))          # cross-attention
    with pytest.raises(UnsupportedFeatureError):
        attn(q, q, q, attn_mask=torch.ones(9, 9, dtype=torch.bool))
    # shorter than a bucket: one chunk, no padding needed; L = 1: itself
    out = attn(q[:, :, :1], q[:, :, :1], q[:, :, :1] * 2)
    torch.testing.assert_close(out, q[:, :, :1] * 2)


# ------------------------------------------------------------------ the engine's explicit plans
def _random_tiles(B, H, nq, nk, C, bq, bk, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.stack([torch.randperm(nk, generator=g)[:C] for _ in range(B * H * nq)]).view(B, H, nq, C)
    kv[..., -1] = torch.where(torch.rand(B, H, nq, generator=g) < 0.3, -1, kv[..., -1])   # some unused slots
    bank = torch.rand(B, H, nq, C, bq, bk, generator=g) < 0.6
    return kv, bank


def _dense(kv, bank, L, S):
    B, H, nq, C, bq, bk = bank.shape
    keep = torch.zeros(B, H, nq * bq, math.ceil(S / bk) * bk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for n in range(nq):
                for c in range(C):
                    j = int(kv[b, h, n, c])
                    if j >= 0:
                        keep[b, h, n * bq:(n + 1) * bq, j * bk:(j + 1) * bk] = bank[b, h, n, c]
    return keep[:, :, :L, :S]


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_plan_matches_the_dense_mask_with_lse_and_its_gradient(backend):
    B, H, L, S, bq, bk = 2, 2, 21, 19, 4, 5
    nq, nk = math.ceil(L / bq), math.ceil(S / bk)
    kv, bank = _random_tiles(B, H, nq, nk, 3, bq, bk, seed=3)
    p = explicit_plan(kv, bank, L, S)
    keep = _dense(kv, bank, L, S)
    assert p.attended_pairs == int(keep.sum())
    q, k, v = rand((B, H, L, 6), 1), rand((B, H, S, 6), 2), rand((B, H, S, 3), 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attend_plan(*leaves, p, backend=backend, return_lse=True)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attend(*ref_leaves, masks.from_tensor(keep))
    s = (ref_leaves[0] @ ref_leaves[1].transpose(-1, -2)) / math.sqrt(6)
    ref_lse = torch.logsumexp(s.masked_fill(~keep, float("-inf")), -1)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)        # -inf for rows with no key on both sides
    fin = torch.isfinite(ref_lse)
    w = rand(lse.shape, 9)
    got = torch.autograd.grad(proj_sum(out) + (lse.masked_fill(~fin, 0) * w).sum(), leaves)
    want = torch.autograd.grad(proj_sum(ref) + (ref_lse.masked_fill(~fin, 0) * w).sum(), ref_leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_explicit_plan_refuses_bad_tiles():
    kv = torch.tensor([[[[0, 0]]]])
    with pytest.raises(InvalidInputError, match="twice"):
        explicit_plan(kv, torch.ones(1, 1, 1, 2, 4, 4, dtype=torch.bool), 4, 8)
    with pytest.raises(InvalidInputError, match="key block"):
        explicit_plan(torch.tensor([[[[5]]]]), torch.ones(1, 1, 1, 1, 4, 4, dtype=torch.bool), 4, 8)
    with pytest.raises(InvalidInputError, match="cover"):
        explicit_plan(torch.tensor([[[[0]]]]), torch.ones(1, 1, 1, 1, 4, 4, dtype=torch.bool), 9, 8)
    p = explicit_plan(torch.tensor([[[[0]]]]), torch.ones(1, 1, 1, 1, 4, 4, dtype=torch.bool), 4, 4)
    q = rand((1, 1, 5, 2), 0)
    with pytest.raises(InvalidInputError, match="plan"):
        attend_plan(q, q, q, p)
    with pytest.raises(InvalidInputError, match="backend"):
        attend_plan(q[:, :, :4], q[:, :, :4], q[:, :, :4], p, backend="flex")


def _perms(N, R, L, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(L, generator=g) for _ in range(R)]) for _ in range(N)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("L, D, half", [(50, 8, 5), (37, 16, 40)])
def test_numba_hash_labels_equal_the_torch_argmax_in_slabs(dtype, L, D, half):
    """The numba labels (a block of rows at a time, 7 rows an item) equal ``argmax([xR; -xR])``, zero rows included
    (40 buckets a side: the transposed rotations through the 16-row panels)."""
    from attnkit_sparse.lsh.hashing import rotations
    from attnkit_sparse.lsh.rounds import labels
    B, H, R = 2, 3, 3
    x = rand((B, H, L, D), 6).to(dtype)
    x[0, 1, 4] = 0.0                                    # all projections 0: label 0 (the first maximum)
    rot = rotations(1, R, D, half, dtype=dtype, device=torch.device("cpu"))
    rot[0, :, 3] = rot[0, :, 1]                         # exact ties: the first maximum / minimum wins
    rot[1, :, 4] = rot[1, :, 2]
    out = labels(x, rot, half, torch.empty(B, H, R, L, dtype=torch.long), rows_per_item=7)   # 43 items
    proj = torch.einsum("bhld,rdn->bhrln", x, rot)
    want = torch.cat([proj, -proj], -1).argmax(-1)
    assert torch.equal(out, want)
    assert int(out[0, 1, :, 4].abs().sum()) == 0


@pytest.mark.parametrize("padded", [False, True])
def test_counting_sort_equals_the_stable_argsort_and_its_inverse(padded, monkeypatch):
    """The CPU counting sort of the rounds (numba) gives the stable argsort by (bucket, position) and its inverse,
    padded positions last, as the torch path does."""
    from attnkit_sparse.lsh import hashing
    g = torch.Generator().manual_seed(3)
    bk = torch.randint(0, 6, (2, 3, 4, 41), generator=g)
    kpm = None
    if padded:
        kpm = torch.ones(2, 41, dtype=torch.bool)
        kpm[0, -5:] = False
        kpm[1, [0, 9]] = False
    perm, inv = hashing.sort_rounds_inverse(bk, kpm)
    monkeypatch.setattr(hashing, "_numba_ok", lambda: False)           # the torch path
    want, want_inv = hashing.sort_rounds_inverse(bk, kpm)
    assert torch.equal(perm, want) and torch.equal(inv, want_inv)
    assert torch.equal(inv, perm.argsort(-1))
    key = torch.where(kpm[:, None, None, :], bk, 6) if padded else bk
    assert bool((key.gather(-1, perm).diff(dim=-1) >= 0).all())        # sorted by bucket, padded last
