"""``performer``: the naive reference against every backend, the stabilisers, the random-feature API."""

from __future__ import annotations

import pytest
import torch
from comparisons import against_reference, backends, build, padding

import attnkit
from attnkit.testing import CheckFailed, ConformanceConfig
from attnkit.testing.scaled_inputs import check_scaled_inputs
from attnkit_kernelized import feature_maps
from attnkit_kernelized.common import padded, zero_padded
from attnkit_kernelized.performer.module import PerformerAttention
from attnkit_kernelized.plugin import PERFORMER

OPTIONS = [{"num_features": 16}, {"num_features": 16, "orthogonal": False, "scale": 0.3},
           {"num_features": 8, "feature_map": "trig"}, {"num_features": 16, "feature_map": "generalized"}]
BACKENDS = backends("torch", "numba", "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opts", OPTIONS, ids=str)
@pytest.mark.parametrize("causal,L,S", [(True, 21, 21), (False, 13, 13), (False, 7, 11)])
@pytest.mark.parametrize("pad", [False, True])
def test_module_matches_naive_reference(backend, opts, causal, L, S, pad):
    # std 0.5: the trig map's denominator changes sign for large inputs (an ill-conditioned ratio)
    against_reference("performer", opts, backend, causal=causal, L=L, S=S, kpm=padding(2, S) if pad else None,
                      std=0.5, segment=8 if causal else None)


def test_stabilisers_are_constants_that_cancel():
    """The stabilised non-causal features give the paper's kernel up to one factor per query row (the
    per-feature key maxima move into the queries), so the attention weights are the same."""
    attn = build("performer", num_features=32)
    q, k = torch.randn(2, 2, 6, 4, dtype=torch.float64) * 2, torch.randn(2, 2, 6, 4, dtype=torch.float64) * 2
    kpm = padding(2, 6)
    phi_q, phi_k = attn.feature_pair(q, k, causal=False, key_padding_mask=kpm)
    s, w = 0.5 ** 0.5, attn.features.double()
    raw_q, raw_k = feature_maps.favor_positive(q * s, w), feature_maps.favor_positive(k * s, w)
    ratio = (phi_q @ phi_k.transpose(-1, -2)) / (raw_q @ raw_k.transpose(-1, -2))     # (B, H, L, S)
    real = kpm[:, None, None, :].expand_as(ratio)
    for b in range(2):
        r = ratio[b][real[b]].view(2, 6, -1)
        torch.testing.assert_close(r, r[..., :1].expand_as(r))                       # one factor per query
    assert (phi_k[~kpm[:, None, :, None].expand_as(phi_k)] == 0).all()
    assert phi_k.max() <= 1 and phi_q.max() <= 1
    # each query's largest feature is exp(0) = 1
    torch.testing.assert_close(phi_q.amax(-1), torch.ones(2, 2, 6, dtype=torch.float64))


def test_redraw_api():
    a = attnkit.build("performer", num_heads=2, head_dim=4, num_features=8, seed=3)
    b = attnkit.build("performer", num_heads=2, head_dim=4, num_features=8, seed=3)
    torch.testing.assert_close(a.features, b.features)          # reproducible from the seed
    first = a.features.clone()
    a.redraw_features()
    assert not torch.allclose(a.features, first)
    b.redraw_features()
    torch.testing.assert_close(a.features, b.features)          # the n-th draw is reproducible too
    a.redraw_features(seed=123)
    c = attnkit.build("performer", num_heads=2, head_dim=4, num_features=8, seed=123)
    torch.testing.assert_close(a.features, c.features)
    assert "features" in a.state_dict()


def test_redraws_every_n_training_calls_only():
    attn = attnkit.build("performer", num_heads=1, head_dim=4, num_features=8, redraw_interval=2, seed=0)
    q = torch.randn(1, 1, 5, 4)
    seen = []
    attn.train()
    for _ in range(5):
        attn(q, q, q)
        seen.append(attn.features.clone())
    changed = [not torch.equal(a, b) for a, b in zip(seen, seen[1:])]
    assert changed == [False, True, False, True]
    attn.eval()
    before = attn.features.clone()
    for _ in range(3):
        attn(q, q, q)
    assert torch.equal(attn.features, before)


def test_orthogonal_features_are_orthogonal_in_blocks():
    w = feature_maps.draw_gaussian_features(12, 4, orthogonal=True, generator=torch.Generator().manual_seed(0),
                                            dtype=torch.float64)
    for b in range(3):
        blk = w[4 * b:4 * (b + 1)]
        gram = blk @ blk.T
        assert (gram - torch.diag(torch.diagonal(gram))).abs().max() < 1e-10
    iid = feature_maps.draw_gaussian_features(12, 4, orthogonal=False, generator=torch.Generator().manual_seed(0),
                                              dtype=torch.float64)
    gram = iid[:4] @ iid[:4].T
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() > 1e-3


def test_favor_positive_is_positive_and_unbiased_at_zero():
    w = feature_maps.draw_gaussian_features(64, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    phi = feature_maps.favor_positive(torch.zeros(8, dtype=torch.float64), w)
    assert torch.all(phi > 0)
    torch.testing.assert_close((phi * phi).sum(), torch.tensor(1.0, dtype=torch.float64))   # exp(0 . 0) = 1


class _Unstabilised(PerformerAttention):
    """The features as the paper writes them, no shift (what this plugin computed before the log-space form)."""

    _log_space = False

    def feature_pair(self, q, k, *, causal, key_padding_mask=None):
        s, w = self.get_scale(q) ** 0.5, self.features.to(q.dtype)
        return (feature_maps.favor_positive(q, w, scale=s),
                zero_padded(feature_maps.favor_positive(k, w, scale=s), padded(key_padding_mask)))


def test_the_kit_catches_unstabilised_features_and_passes_ours():
    """Unshifted FAVOR+ features give all-zero rows for q, k scaled by 10 in float32: the kit's scaled_inputs
    check fails on them and passes on the module (causal and non-causal, both forms of stabiliser)."""
    with attnkit.registered(_Unstabilised, name="performer-unstabilised", exact=False,
                            reference="attnkit_kernelized.performer.naive:reference",
                            capabilities=PERFORMER.capabilities):
        with pytest.raises(CheckFailed, match=r"scaled by (10|30|100).*(all zeros|non-finite)"):
            check_scaled_inputs(ConformanceConfig(name="performer-unstabilised", options={"num_features": 64}))
    for opts in ({"num_features": 64}, {"num_features": 64, "feature_map": "trig"}):
        assert "x100" in check_scaled_inputs(ConformanceConfig(name="performer", options=opts))


@pytest.mark.parametrize("scale", [10.0, 30.0, 100.0, 1e4])
@pytest.mark.parametrize("causal", [True, False])
def test_large_inputs_and_scale_give_no_zero_rows(scale, causal):
    """The inputs of the issue: D=64, M=256, float32, q and k scaled (and scale=1e4 on unit inputs)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g) for _ in range(3))
    if scale == 1e4:
        attn = attnkit.build("performer", num_heads=2, head_dim=64, num_features=256, seed=0, scale=1e4)
    else:
        attn = attnkit.build("performer", num_heads=2, head_dim=64, num_features=256, seed=0)
        q, k = q * scale, k * scale
    out = attn(q, k, v, causal=causal)
    assert torch.isfinite(out).all()
    assert (out.abs().amax(-1) > 0).all()
    attn64 = attn.double()
    want = attnkit.get_spec("performer").load_reference()(
        attn64, q.double(), k.double(), v.double(), mask=attnkit.masks.resolve(causal=causal))
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-3


@pytest.mark.parametrize("feature_map", ["positive", "trig"])
@pytest.mark.parametrize("causal,L,S", [(True, 21, 21), (False, 13, 9)])
@pytest.mark.parametrize("std", [10.0, 30.0])
def test_large_norm_inputs_match_the_reference_with_gradients(feature_map, causal, L, S, std):
    """float64, q, k, v of std 10 and 30 (exponents in the thousands: the causal form's chunks then take the
    pairwise path), padding, segments of 8 with the state carried: outputs and gradients equal the reference."""
    against_reference("performer", {"num_features": 16, "feature_map": feature_map}, "torch", causal=causal, L=L,
                      S=S, kpm=padding(2, S), std=std, segment=8 if causal else None)


def test_the_pairwise_path_is_taken_and_agrees_with_the_factored_one():
    """With exponents growing sharply inside a chunk the block is computed pairwise; with a large limit the
    factored block (which is then exact in float64 too) gives the same outputs."""
    from attnkit_kernelized.performer import chunk as performer_chunk

    g = torch.Generator().manual_seed(0)
    lq, lk = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) * 60 for _ in range(2))
    v = torch.randn(1, 2, 16, 3, generator=g, dtype=torch.float64)
    calls = []
    real = performer_chunk._pairwise_chunks

    def spy(*args):
        calls.append(int(args[2].sum()))
        return real(*args)

    performer_chunk._pairwise_chunks = spy
    try:
        out, _ = performer_chunk.log_space_causal(lq, lk, v, chunk=8)
    finally:
        performer_chunk._pairwise_chunks = real
    assert calls and calls[0] > 0
    old = dict(performer_chunk.GROWTH_LIMIT)
    performer_chunk.GROWTH_LIMIT[torch.float64] = 600.0
    try:
        factored, _ = performer_chunk.log_space_causal(lq, lk, v, chunk=8)
    finally:
        performer_chunk.GROWTH_LIMIT.clear()
        performer_chunk.GROWTH_LIMIT.update(old)
    torch.testing.assert_close(out, factored)


@pytest.mark.parametrize("C", [1, 2, 5, 8, 64])
def test_prefix_max_equals_cummax(C):
    """The doubling running maximum a program uses for its selected chunks (``cummax`` does not trace over a
    selection of unbacked size) equals ``cummax`` at chunk sizes below, at and between powers of two, ties and
    -inf included."""
    from attnkit_kernelized.performer.chunk import _prefix_max

    g = torch.Generator().manual_seed(C)
    x = torch.randint(-3, 4, (3, C, 5), generator=g).double()
    x[0, 0] = float("-inf")
    torch.testing.assert_close(_prefix_max(x), torch.cummax(x, dim=-2).values, rtol=0, atol=0)


def test_the_programs_selection_form_equals_eager_with_and_without_marked_chunks(monkeypatch):
    """What a program runs (``recompute="auto"`` while exporting: the marked chunks selected, their shifts by
    the doubling maximum) equals eager's form, values and gradients in float64, on inputs that mark no chunk (the
    selection empty) and on inputs that mark some (exponents times 100)."""
    from attnkit_kernelized.performer import chunk as performer_chunk

    for scale, marks in ((0.5, False), (100.0, True)):
        g = torch.Generator().manual_seed(int(scale))
        lq, lk = (torch.randn(1, 2, 21, 8, generator=g, dtype=torch.float64) * scale for _ in range(2))
        v = torch.randn(1, 2, 21, 3, generator=g, dtype=torch.float64)
        outs = []
        for exporting in (False, True):
            monkeypatch.setattr(torch.compiler, "is_exporting", lambda exporting=exporting: exporting)
            leaves = [x.clone().requires_grad_() for x in (lq, lk, v)]
            out, _ = performer_chunk.log_space_causal(*leaves, chunk=8)
            outs.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
        monkeypatch.undo()
        lk_c = performer_chunk._chunks(lk, 8, 3, performer_chunk.NO_KEY)
        end, _, first = performer_chunk._references(lk_c, lk.new_full((1, 2, 8), performer_chunk.NO_KEY))
        assert bool((end - first).amax() > performer_chunk.GROWTH_LIMIT[torch.float64]) == marks
        for got, want in zip(outs[1], outs[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_log_space_causal_refuses_an_unknown_recompute():
    """``recompute`` takes ``"auto"`` or ``"marked"``; anything else is refused by name, not run as ``"auto"``."""
    from attnkit_kernelized.performer.chunk import log_space_causal

    x = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="recompute must be 'auto' or 'marked', got 'none'"):
        log_space_causal(x, x, x, recompute="none")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounded_and_log_space_forms_hand_the_state_to_each_other(backend):
    """A causal stream whose first segment has tame inputs (the linear kernels run) and whose second has
    large-norm keys (the log-space form runs), and the reverse: outputs and gradients equal the reference."""
    attn = build("performer", backend=backend, num_features=16, chunk_size=4)
    attn.segment_length = attn.trained_segment_length = 8
    ref_fn = attnkit.get_spec("performer").load_reference()
    for big_first in (False, True):
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(2, 2, 16, 4, generator=g, dtype=torch.float64) for _ in range(3))
        factor = torch.ones(1, 1, 16, 1, dtype=torch.float64)
        factor[:, :, :8] = 1.0 if not big_first else 40.0
        factor[:, :, 8:] = 40.0 if not big_first else 1.0
        q, k = (q * factor).requires_grad_(), (k * factor).requires_grad_()
        v.requires_grad_()
        out = attn(q, k, v, causal=True)
        want = ref_fn(attn, q, k, v, mask=attnkit.masks.resolve(causal=True), positions=None)
        torch.testing.assert_close(out, want, atol=1e-9, rtol=1e-7)
        for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
            torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-6)
