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
    # float32/float64 only: with init_span 6 and ramp 3 the soft mask reaches 0 exactly at distance 9, a key's
    # distance. In half the kit rounds the span bias to float16, and whether that key keeps a weight of ~1e-7 or
    # 0 then depends on the last bit of z (float32 inside, float64 in the reference); under key padding it can be
    # a query's only key, so the renormalised output jumps between v and 0. Half: the class below.
    dtypes_to_test = ("float32", "float64")


class TestDynamicSpanHalfConformance(AttentionConformance):
    name = "dynamic-span"
    options = {"max_span": 16, "ramp": 3.0, "init_span": 6.3, "block_size": 4}   # the mask's zero between keys
    dtypes_to_test = ("float16", "bfloat16")


class TestEntmaxConformance(AttentionConformance):
    name = "entmax"
    options = {"alpha": 1.5}


class TestEntmaxSparsemaxConformance(AttentionConformance):
    name = "entmax"
    options = {"alpha": [2.0, 1.2], "learn_alpha": False}


class TestSparseAdaptiveConformance(AttentionConformance):
    name = "sparse-adaptive"
    options = {"num_edges": 3, "predictor_dim": 4, "distance_buckets": 4, "chunk_size": 5}
    # float32/float64 only: the top-3 edges are picked from predictor scores, and half inputs (few distinct
    # values) make exact ties there; float32 inside and the float64 reference then break a tie differently and
    # pick different keys. Half precision is checked with every edge kept (the class below) and in test_half.py.
    dtypes_to_test = ("float32", "float64")


class TestSparseAdaptiveAllEdgesConformance(AttentionConformance):
    name = "sac"
    options = {"num_edges": 200, "chunk_size": 64}


class TestAdaptiveSpanDefaultsConformance(AttentionConformance):
    """The default options (what ``attnkit check adaptive-span`` runs)."""

    name = "adaptive-span"
