"""The attnkit conformance kit on every registered name (small options so spans cross block boundaries)."""

from __future__ import annotations

from attnkit.testing import AttentionConformance


class TestAdaptiveSpanConformance(AttentionConformance):
    name = "adaptive-span"
    options = {"max_span": 16, "ramp": 3.0, "init_span": 5.5, "block_size": 4}


class TestAdaptiveSpanFullConformance(AttentionConformance):
    name = "adaptive-span"
    options = {"max_span": 128, "ramp": 8.0, "init_span": 100.0, "block_size": 8}


class TestDynamicSpanConformance(AttentionConformance):
    name = "dynamic-span"
    options = {"max_span": 16, "ramp": 3.0, "init_span": 6.0, "block_size": 4}


class TestEntmaxConformance(AttentionConformance):
    name = "entmax"
    options = {"alpha": 1.5}


class TestEntmaxSparsemaxConformance(AttentionConformance):
    name = "entmax"
    options = {"alpha": [2.0, 1.2], "learn_alpha": False}


class TestSparseAdaptiveConformance(AttentionConformance):
    name = "sparse-adaptive"
    options = {"num_edges": 3, "predictor_dim": 4, "distance_buckets": 4, "chunk_size": 5}


class TestSparseAdaptiveAllEdgesConformance(AttentionConformance):
    name = "sac"
    options = {"num_edges": 200, "chunk_size": 64}


class TestAdaptiveSpanDefaultsConformance(AttentionConformance):
    """The default options (what ``attnkit check adaptive-span`` runs)."""

    name = "adaptive-span"
