"""The kit's ``reference`` check in a lower precision reads the module under test's own (rounded) parameters.

A learned discrete choice (top-k edges, a bucket) can flip on a parameter's rounding alone: the module built in
float16 holds its parameters rounded to float16, and a reference reading a separately built float64 module
would take the other branch. The kit hands the reference a float64 copy of the module under test instead.
"""

from __future__ import annotations

import torch
from broken_impls import NaiveAttention
from torch import nn

import attnkit
from attnkit.reference import softmax_reference
from attnkit.testing import run_conformance

#: between 0.1 and its float16 rounding (0.0999755859375): the branch the parameter takes depends on its dtype
_CUT = 0.09999


class ThresholdAttention(NaiveAttention):
    """Softmax attention, negated when the parameter ``t`` (0.1) rounds below :data:`_CUT` (float16 does)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.t = nn.Parameter(torch.tensor(0.1))

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        out = super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return out if float(self.t.detach()) > _CUT else -out


def threshold_reference(attn, q, k, v, *, mask=None, positions=None):
    out = softmax_reference(attn, q, k, v, mask=mask, positions=positions)
    return out if float(attn.t.detach()) > _CUT else -out


def test_half_reference_reads_the_rounded_parameters():
    assert float(torch.tensor(0.1).half()) < _CUT < 0.1
    caps = attnkit.Capabilities(dtypes=("float16", "float64"))
    with attnkit.registered(ThresholdAttention, name="kit-threshold", capabilities=caps,
                            reference="test_kit_reference_rounding:threshold_reference"):
        check = run_conformance("kit-threshold", checks=["reference"])["reference"]
    assert check.status == "passed", check.message
