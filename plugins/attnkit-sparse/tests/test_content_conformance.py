"""The attnkit conformance kit on the content-based mechanisms (``lsh`` and its alias ``reformer``).

Every backend is held to the spec's reference (``attnkit_sparse.lsh.naive:reference``: the dense
mask counted from the same hashes, then masked softmax) in float64, outputs and gradients. Small
buckets so the kit's lengths (9, 12, 67) make several chunks, a ragged last one and several buckets.
"""

from __future__ import annotations

from attnkit.testing import AttentionConformance

_LSH_SKIPS = {
    "causality": "the sorted chunks depend on every position's bucket, future ones included (as in the paper): "
                 "with causal=True no pair attends the future (test_lsh.py::test_causal_pairs_never_attend_the_"
                 "future), but a future token can change which past keys share a chunk",
}


class TestLSHConformance(AttentionConformance):
    name = "lsh"
    options = {"bucket_size": 4, "n_hashes": 2, "seed": 3}
    queries_interact = True
    skip = _LSH_SKIPS


class TestReformerAliasConformance(AttentionConformance):
    name = "reformer"
    options = {"bucket_size": 8, "n_hashes": 3}
    queries_interact = True
    skip = _LSH_SKIPS


_ROUTING_SKIPS = {
    "causality": "the top-w choice of each centroid ranks every position, future ones included (as in the "
                 "paper): with causal=True no pair attends the future (test_routing.py), but a future token "
                 "can change which past keys a cluster routes",
}


class TestRoutingConformance(AttentionConformance):
    name = "routing"
    options = {"num_clusters": 3, "seed": 2}
    queries_interact = True
    skip = _ROUTING_SKIPS


class TestSinkhornConformance(AttentionConformance):
    name = "sinkhorn"
    options = {"block_size": 4, "sinkhorn_iters": 3, "temperature": 0.5}
