"""The ``scaled_inputs`` check: approximate mechanisms stay finite, non-zero and close to their reference
when q and k are scaled by 10, 30 and 100; deliberately broken ones are caught."""

from __future__ import annotations

import broken_impls
import pytest
import torch

import attnkit
from attnkit.testing import CheckFailed, CheckSkipped, ConformanceConfig
from attnkit.testing.checks import CHECKS, check_scaled_inputs


class _ExpWeights(broken_impls.NaiveAttention):
    """Softmax written as ``exp(score - shift_i) / sum``: correct in exact arithmetic for any per-row shift."""

    def shift(self, q, scores, keep):
        raise NotImplementedError

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        scores = q @ k.transpose(-2, -1) * self.get_scale(q)
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if causal:
            keep = torch.ones_like(keep).tril()
        keep = keep.expand_as(scores)
        if key_padding_mask is not None:
            keep = keep & key_padding_mask[:, None, None, :]
        w = torch.where(keep, torch.exp(scores - self.shift(q, scores, keep)), torch.zeros(()))
        den = w.sum(-1, keepdim=True)
        return torch.where(den == 0, torch.zeros(()), w @ v / torch.where(den == 0, torch.ones(()), den))


class UnshiftedExpAttention(_ExpWeights):
    """No shift: exp overflows to inf for large scores (inf / inf = NaN)."""

    def shift(self, q, scores, keep):
        return torch.zeros(())


class RowMaxExpAttention(_ExpWeights):
    """Shifted by the row maximum: the stable form, which passes."""

    def shift(self, q, scores, keep):
        top = scores.detach().masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
        return torch.where(torch.isneginf(top), torch.zeros_like(top), top)


APPROX = {"exact": False, "reference": broken_impls.softmax_reference, "capabilities": broken_impls.BASIC}


def test_the_check_is_in_the_table():
    assert "scaled_inputs" in CHECKS


def test_overflowing_features_are_caught():
    with attnkit.registered(UnshiftedExpAttention, name="kit-unshifted-exp", **APPROX):
        with pytest.raises(CheckFailed, match=r"scaled by \d+.*non-finite"):
            check_scaled_inputs(ConformanceConfig(name="kit-unshifted-exp"))


def test_underflowing_rows_are_caught():
    with attnkit.registered(broken_impls.UnderflowingExpAttention, name="kit-norm-shifted", **APPROX):
        with pytest.raises(CheckFailed, match=r"scaled by 10.*output rows are all zeros"):
            check_scaled_inputs(ConformanceConfig(name="kit-norm-shifted"))


def test_a_stable_approximation_passes_with_figures():
    with attnkit.registered(RowMaxExpAttention, name="kit-row-max", **APPROX):
        note = check_scaled_inputs(ConformanceConfig(name="kit-row-max"))
    assert "x10" in note and "x100" in note


def test_a_wrong_result_at_large_scale_is_caught():
    class Wrong(RowMaxExpAttention):
        def _forward(self, q, k, v, **kw):
            out = super()._forward(q, k, v, **kw)
            return out * 1.5 if q.abs().max() > 20 else out      # right at unit scale only

    with attnkit.registered(Wrong, name="kit-wrong-large", **APPROX):
        with pytest.raises(CheckFailed, match=r"relative Frobenius error .* exceeds"):
            check_scaled_inputs(ConformanceConfig(name="kit-wrong-large"))


def test_exact_specs_are_skipped():
    with pytest.raises(CheckSkipped, match="exact"):
        check_scaled_inputs(ConformanceConfig(name="softmax"))


C_TINY = 0.1


class _TinyKernel(broken_impls.NaiveAttention):
    """Unnormalised ``w_ij = exp(-c (|q_i|^2 + |k_j|^2))``, ``out = w v``: its output itself shrinks with the
    inputs' norm (as SOFT's Gaussian kernel does) and at q, k x30 lies wholly below float32's range, where
    the only faithful float32 answer is 0."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        return torch.exp(-C_TINY * ((q * q).sum(-1, keepdim=True) + (k * k).sum(-1)[..., None, :])) @ v


def _tiny_reference(attn, q, k, v, *, mask, positions):
    return torch.exp(-C_TINY * ((q * q).sum(-1, keepdim=True) + (k * k).sum(-1)[..., None, :])) @ v


class _TinyKernelUnderflowing(_TinyKernel):
    """The same as a product of fourth powers, then the fourth root: the product underflows in float32 where the
    result (x10: up to ~1e-17) would not."""

    def _forward(self, q, k, v, **kw):
        a = torch.exp(-4 * C_TINY * (q * q).sum(-1, keepdim=True))
        b = torch.exp(-4 * C_TINY * (k * k).sum(-1))[..., None, :]
        return (a * b) ** 0.25 @ v


TINY = {"exact": False, "reference": _tiny_reference,
        "capabilities": attnkit.Capabilities(causal=False, key_padding_mask=False, cross=True)}


def test_a_reference_below_the_dtype_range_asks_for_zeros_not_a_failure():
    from attnkit.testing.context import make_inputs
    q, k, v = make_inputs(2, 2, 9, 9, 8, 6, dtype=torch.float64, seed=17)
    ref = _tiny_reference(None, q * 30, k * 30, v, mask=None, positions=None)
    assert 0 < ref.abs().max() < torch.finfo(torch.float32).smallest_normal * 2 ** -24     # premise: below range
    with attnkit.registered(_TinyKernel, name="kit-tiny-kernel", **TINY):
        note = check_scaled_inputs(ConformanceConfig(name="kit-tiny-kernel"))
    assert "x30: 0" in note and "x100: 0" in note


def test_underflow_where_the_dtype_could_hold_the_result_is_still_caught():
    with attnkit.registered(_TinyKernelUnderflowing, name="kit-tiny-underflow", **TINY):
        with pytest.raises(CheckFailed, match=r"scaled by 10.*output rows are all zeros"):
            check_scaled_inputs(ConformanceConfig(name="kit-tiny-underflow"))
