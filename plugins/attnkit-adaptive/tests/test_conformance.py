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
    # every declared dtype: until session 44 the kit's reference read a separately built float64 module, whose
    # span parameters were not rounded like the half module's, and with the soft mask reaching 0 exactly at a
    # key's distance that key's weight flipped between ~1e-7 and 0; the reference now reads the module's own
    # (rounded) parameters, and this class ran float32/float64 only before


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
    # every declared dtype: the top-3 edges flipped in half when the kit's reference read a float64 build with
    # unrounded predictor weights (so this class ran float32/float64 only until session 44); it now reads the
    # module's own rounded weights


class TestSparseAdaptiveAllEdgesConformance(AttentionConformance):
    name = "sac"
    options = {"num_edges": 200, "chunk_size": 64}


class TestAdaptiveSpanDefaultsConformance(AttentionConformance):
    """The default options (what ``attnkit check adaptive-span`` runs)."""

    name = "adaptive-span"
