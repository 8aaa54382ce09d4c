"""``sinkhorn``: backends against the reference (incl. the sorting network's gradient), one block = exact, rules."""

from __future__ import annotations

import pytest
import torch
from conftest import proj_sum, rand

import attnkit
from attnkit import masks
from attnkit.errors import InvalidInputError, UnsupportedFeatureError
from attnkit_sparse.sinkhorn.naive import reference

BACKENDS = ("torch", "numba")
TOL = dict(atol=1e-10, rtol=1e-9)


def _build(**kw):
    return attnkit.build("sinkhorn", num_heads=2, head_dim=8, **kw).double().eval()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("L", [24, 27])          # 27: not a multiple of the block size (padded at the end)
def test_backends_match_reference_with_the_sorting_network_gradient(backend, causal, L):
    attn = _build(block_size=4, sinkhorn_iters=4, backend=backend)
    q, k, v = rand((2, 2, L, 8), 1), rand((2, 2, L, 8), 2), rand((2, 2, L, 5), 3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attn(*leaves, causal=causal)
    got = torch.autograd.grad(proj_sum(out), [*leaves, attn.sort_weight])
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(attn, *ref_leaves, mask=masks.causal() if causal else None)
    want = torch.autograd.grad(proj_sum(ref), [*ref_leaves, attn.sort_weight])
    torch.testing.assert_close(out, ref, **TOL)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert got[3].abs().sum() > 0                    # the sorting network learns


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_block_is_exact_attention(backend, causal):
    attn = _build(block_size=64, backend=backend)
    q, k, v = rand((1, 2, 13, 8), 1), rand((1, 2, 13, 8), 2), rand((1, 2, 13, 5), 3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(attn(q, k, v, causal=causal), want, **TOL)


def test_sorting_matrix_is_doubly_stochastic_and_causal_rows_take_the_past():
    attn = _build(block_size=4, sinkhorn_iters=50)
    k = rand((1, 2, 32, 8), 2)
    s = attn.sort_matrix(k, causal=False)
    torch.testing.assert_close(s.sum(-1), torch.ones(1, 2, 8, dtype=s.dtype), atol=1e-6, rtol=0)
    torch.testing.assert_close(s.sum(-2), torch.ones(1, 2, 8, dtype=s.dtype), atol=1e-6, rtol=0)
    c = attn.sort_matrix(k, causal=True)
    assert float(c.detach().triu().abs().sum()) == 0.0
    torch.testing.assert_close(c[..., 1:, :].sum(-1), torch.ones(1, 2, 7, dtype=c.dtype))
    # a lower temperature sharpens towards a permutation
    sharp = _build(block_size=4, sinkhorn_iters=50, temperature=0.05).sort_matrix(k, causal=False)
    assert float(sharp.detach().amax(-1).mean()) > float(s.detach().amax(-1).mean())


def test_causal_outputs_ignore_the_future():
    attn = _build(block_size=4)
    q, k, v = rand((1, 2, 20, 8), 1), rand((1, 2, 20, 8), 2), rand((1, 2, 20, 5), 3)
    base = attn(q, k, v, causal=True)
    for t in (3, 4, 9, 16):
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, :, t:] += 5.0
        torch.testing.assert_close(attn(q2, k2, v2, causal=True)[:, :, :t], base[:, :, :t], **TOL)


def test_gumbel_noise_in_training_only():
    attn = _build(block_size=4)
    q, k, v = rand((1, 2, 16, 8), 1), rand((1, 2, 16, 8), 2), rand((1, 2, 16, 5), 3)
    torch.testing.assert_close(attn(q, k, v), attn(q, k, v), atol=0, rtol=0)
    attn.train()
    torch.manual_seed(0)
    a = attn(q, k, v)
    b = attn(q, k, v)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()   # (a NaN noise once made every row NaN)
    assert not torch.allclose(a, b)
    # the noise is Gumbel(0, 1): the sorting logits move by a mean of Euler's constant, variance pi^2 / 6
    torch.manual_seed(1)
    big = torch.zeros(1, 2, 64 * 4, 8, dtype=torch.float64)                 # 2 x 64 x 64 noise draws
    with torch.no_grad():
        attn.sinkhorn_iters, attn.temperature = 0, 1.0
        noise = attn.sort_matrix(big, causal=False).log()    # zero keys: logits 0, so exp(noise) comes back
    assert abs(noise.mean().item() - 0.5772) < 0.05 and abs(noise.var().item() - 1.6449) < 0.15


def test_bad_input():
    for kw, name in (({"block_size": 0}, "block_size"), ({"temperature": 0.0}, "temperature"),
                     ({"sinkhorn_iters": 0}, "sinkhorn_iters")):
        with pytest.raises(InvalidInputError, match=name):
            attnkit.build("sinkhorn", head_dim=8, **kw)
    with pytest.raises(InvalidInputError, match="head_dim"):
        attnkit.build("sinkhorn")
    attn = _build(block_size=4)
    q = rand((1, 2, 8, 8), 0)
    with pytest.raises(UnsupportedFeatureError, match="key_padding"):
        attn(q, q, q, key_padding_mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(UnsupportedFeatureError):
        attn(q, rand((1, 2, 6, 8), 1), rand((1, 2, 6, 8), 2))
    mha = attnkit.MultiHeadAttention(16, 2, "sinkhorn", block_size=4)
    assert mha(torch.randn(2, 10, 16), causal=True).shape == (2, 10, 16)


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs_as_multi_head_attention_passes_them(causal):
    """The head split of MultiHeadAttention gives (B, H, L, D) views that are not contiguous (a `.view` on
    them failed); the output equals the one from contiguous copies, and a Transformer trains with it."""
    attn = _build(block_size=4, sinkhorn_iters=4)
    q, k, v = (rand((2, 24, 2, 8), s).transpose(1, 2) for s in (1, 2, 3))   # (B, H, L, D), strided
    assert not q.is_contiguous()
    want = attn(q.contiguous(), k.contiguous(), v.contiguous(), causal=causal)
    torch.testing.assert_close(attn(q, k, v, causal=causal), want, **TOL)
    model = attnkit.Transformer(16, 1, 2, attention="sinkhorn", attention_options={"block_size": 4})
    model(torch.randn(2, 12, 16), causal=causal).sum().backward()


@pytest.mark.parametrize("spread", [1.0, 30.0, 400.0])
def test_scaling_sinkhorn_equals_the_log_domain_iterations_with_gradients(spread):
    """The module's exponential-domain iterations against the log-domain ones (float64, values and gradients);
    logits spread beyond the accepted range fall back to the log domain (still equal, never NaN)."""
    from attnkit_sparse.sinkhorn.sorting import _sinkhorn_scaling, sinkhorn
    logits = (rand((2, 3, 9, 9), 4) * spread).requires_grad_()
    a = sinkhorn(logits, 6, False, scaling=True)
    b = sinkhorn(logits, 6, False, scaling=False)
    used = _sinkhorn_scaling(logits.detach(), 6) is not None
    assert used == (spread < 100)                     # x400 spans ~1900 below a row maximum: log domain
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    w = rand(a.shape, 5)
    ga, = torch.autograd.grad((a * w).sum(), logits)
    gb, = torch.autograd.grad((b * w).sum(), logits)
    assert torch.isfinite(ga).all()
    torch.testing.assert_close(ga, gb, atol=1e-10, rtol=1e-8)
    # float32 accepts a smaller range (60 below each row's maximum)
    for mult, accepted in ((5, True), (40, False)):
        f = (rand((1, 1, 6, 6), 6) * mult).float()
        p = _sinkhorn_scaling(f, 3)
        assert (p is not None) == accepted
        if accepted:
            torch.testing.assert_close(p, sinkhorn(f, 3, False), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("L", [12, 10])
def test_own_and_sorted_equals_the_cat_with_gradients(L):
    """The module's one-buffer ``[x; S·blocks(x)]`` against ``cat`` of the padded blocks and the sorted blocks,
    values and gradients in ``x`` (non-contiguous, with end padding) and ``S``."""
    from attnkit_sparse.sinkhorn.sorting import own_and_sorted, pad_blocks, sorted_blocks
    b, nb = 4, 3
    x = rand((2, 5, 3, L), 1).transpose(1, 3).requires_grad_()         # (2, L, 3, 5) -> non-contiguous (B, H, L, F)
    x = x.transpose(1, 2)                                               # (2, 3, L, 5)
    s = torch.softmax(rand((2, 3, nb, nb), 2), -1).requires_grad_()
    got = own_and_sorted(x, s, b)
    want = torch.cat([pad_blocks(x, b), sorted_blocks(x, s, b)], 2)
    torch.testing.assert_close(got, want, **TOL)
    w = rand(got.shape, 3)
    for a, c in zip(torch.autograd.grad((got * w).sum(), (x, s)), torch.autograd.grad((want * w).sum(), (x, s))):
        torch.testing.assert_close(a, c, **TOL)


@pytest.mark.parametrize("L", [12, 10, 4096])
def test_block_sums_equal_the_reshaped_sum_with_gradients(L):
    """The sorting network's block sums (a backward of its own writing into a reused buffer from L = 4,096 here)
    against ``pad_blocks(x, b).reshape(...).sum(3)``, values and gradients, L a multiple of the block or not."""
    from attnkit_sparse.sinkhorn.sorting import block_sums, pad_blocks
    b = 4 if L < 100 else 64
    x = rand((2, 3, L, 5 if L < 100 else 64), 1).requires_grad_()
    got = block_sums(x, b)
    want = pad_blocks(x, b).reshape(2, 3, -1, b, x.shape[-1]).sum(3)
    torch.testing.assert_close(got, want, **TOL)
    w = rand(got.shape, 2)
    torch.testing.assert_close(torch.autograd.grad((got * w).sum(), x)[0],
                               torch.autograd.grad((want * w).sum(), x)[0], **TOL)


def test_own_and_sorted_reuses_its_cpu_buffer_only_once_nothing_refers_to_it():
    """float32 on the CPU: the ``[x; S·blocks(x)]`` buffer (4 MiB here) comes from ``attnkit.cpu_buffers``; a result
    still held is never written by the next call, and a dropped one's memory serves the next call; the
    backward's ``dx`` (``out=`` a pooled buffer) equals the ``cat`` form's gradient."""
    from attnkit import cpu_buffers
    from attnkit_sparse.sinkhorn.sorting import own_and_sorted, pad_blocks, sorted_blocks
    before = cpu_buffers.limit() >> 20
    cpu_buffers.set_limit(64)
    try:
        b, L, F = 64, 2048, 64
        g = torch.Generator().manual_seed(0)
        x1, x2 = (torch.randn(1, 4, L, F, generator=g) for _ in range(2))
        s = torch.softmax(torch.randn(1, 4, L // b, L // b, generator=g), -1)
        first = own_and_sorted(x1, s, b)
        kept = first.clone()
        second = own_and_sorted(x2, s, b)
        assert second.data_ptr() != first.data_ptr()
        assert torch.equal(first, kept)                          # held: untouched by the second call
        torch.testing.assert_close(second, torch.cat([x2, sorted_blocks(x2, s, b)], 2))
        ptrs = {first.data_ptr(), second.data_ptr()}
        del first, second
        assert own_and_sorted(x1, s, b).data_ptr() in ptrs      # dropped: its memory reused
        xg = x1.clone().requires_grad_()
        w = torch.randn(1, 4, 2 * L, F, generator=g)
        got = torch.autograd.grad((own_and_sorted(xg, s, b) * w).sum(), xg)[0]
        want = torch.autograd.grad((torch.cat([pad_blocks(xg, b), sorted_blocks(xg, s, b)], 2) * w).sum(), xg)[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    finally:
        cpu_buffers.set_limit(before)


@pytest.mark.parametrize("iters", [1, 3, 8])
def test_sinkhorn_knopp_vectors_equal_the_elementwise_normalisations_with_gradients(iters):
    """The scaling-vector form ``diag(a) K diag(b)`` and its own backward against the plain torch expression
    (``p = exp(z); p /= rowsum; p /= colsum`` under autograd), float64, values and gradients, and gradcheck."""
    from attnkit_sparse.sinkhorn.sorting import _SinkhornKnopp
    z = (rand((2, 3, 7, 7), 8) * 3).requires_grad_()
    z0 = z - z.detach().amax(-1, keepdim=True)
    got = _SinkhornKnopp.apply(z0, iters)
    p = z0.exp()
    for _ in range(iters):
        p = p / p.sum(-1, keepdim=True)
        p = p / p.sum(-2, keepdim=True)
    torch.testing.assert_close(got, p, atol=1e-13, rtol=1e-12)
    w = rand(p.shape, 9)
    ga, = torch.autograd.grad((got * w).sum(), z)
    gb, = torch.autograd.grad((p * w).sum(), z)
    torch.testing.assert_close(ga, gb, atol=1e-12, rtol=1e-10)
    zz = rand((1, 2, 4, 4), 10).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: _SinkhornKnopp.apply(x, iters), (zz,))
