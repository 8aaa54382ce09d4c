"""The attnkit conformance kit on all four names (and the ``delta`` alias): one thin subclass each.

The kit holds every backend that can run here to the spec's own reference
(``attnkit_kernelized.<mechanism>.naive:reference``) in float64, and checks
masks, padding, NaN queries, empty sequences, streaming, gradients and
serialisation.
"""

from __future__ import annotations

from attnkit.testing import AttentionConformance


class TestLinearConformance(AttentionConformance):
    name = "linear"


class TestLinearReluConformance(AttentionConformance):
    name = "linear"
    options = {"feature_map": "relu"}


class TestPerformerConformance(AttentionConformance):
    name = "performer"
    options = {"num_features": 64}


class TestRFAConformance(AttentionConformance):
    name = "rfa"
    options = {"num_features": 16}


class TestFastWeightConformance(AttentionConformance):
    name = "fast-weight"


class TestDeltaAliasConformance(AttentionConformance):
    name = "delta"
    options = {"feature_map": "elu", "beta": 0.5}
