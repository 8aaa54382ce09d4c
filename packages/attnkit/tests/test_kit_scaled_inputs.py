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
