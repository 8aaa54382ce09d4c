"""The attnkit conformance kit on the content-based mechanisms (``lsh`` and its alias ``reformer``).

Every backend is held to the spec's reference (``attnkit_sparse.lsh.naive:reference``: the dense
mask counted from the same hashes, then masked softmax) in float64, outputs and gradients. Small
buckets so the kit's lengths (9, 12, 67) make several chunks, a ragged last one and several buckets.

No check is skipped here by hand: ``lsh`` and ``routing`` declare ``queries_interact`` and
``selection_sees_future`` in their specs (a later token can change which earlier keys share a chunk or a
cluster, as in the papers), so the kit skips ``nan_queries`` and ``causality`` for them from the spec, as
``attnkit check`` does. That no attended pair lies in the future is tested in test_lsh.py and test_routing.py.
"""

from __future__ import annotations

from attnkit.testing import AttentionConformance


class TestLSHConformance(AttentionConformance):
    name = "lsh"
    options = {"bucket_size": 4, "n_hashes": 2, "seed": 3}


class TestReformerAliasConformance(AttentionConformance):
    name = "reformer"
    options = {"bucket_size": 8, "n_hashes": 3}


class TestRoutingConformance(AttentionConformance):
    name = "routing"
    options = {"num_clusters": 3, "seed": 2}


class TestSinkhornConformance(AttentionConformance):
    name = "sinkhorn"
    options = {"block_size": 4, "sinkhorn_iters": 3, "temperature": 0.5}
