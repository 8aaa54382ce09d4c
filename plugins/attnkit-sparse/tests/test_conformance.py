"""The attnkit conformance kit on every pattern (and the aliases): one thin subclass each.

The kit holds every backend that can run here to the spec's reference
(``attnkit_sparse.naive:reference``: the dense masked softmax of the module's
own pattern, evaluated element by element) in float64, outputs and
gradients, and checks masks, padding, causality, NaN queries, empty
sequences, streaming, gradients and serialisation. Options are small so the
kit's lengths (9, 12, 67) meet several pattern blocks and ragged ones.
"""

from __future__ import annotations

from attnkit.testing import AttentionConformance


class TestLocalConformance(AttentionConformance):
    name = "local"
    options = {"window": 4}


class TestSlidingWindowAliasConformance(AttentionConformance):
    name = "sliding-window"
    options = {"window": 3}


class TestBandAliasConformance(AttentionConformance):
    name = "band"


class TestDilatedConformance(AttentionConformance):
    name = "dilated"
    options = {"window": 3, "dilation": 2}


class TestDilatedPerHeadConformance(AttentionConformance):
    name = "dilated"
    options = {"window": 3, "dilation": [1, 3], "num_heads": 2}


class TestBlockLocalConformance(AttentionConformance):
    name = "block-local"
    options = {"block_size": 4, "previous": True}


class TestGlobalConformance(AttentionConformance):
    name = "global"
    options = {"window": 3, "global_positions": [0, 5]}


class TestRandomConformance(AttentionConformance):
    name = "random"
    options = {"block_size": 2, "num_random": 2, "seed": 3, "per_head": True}


class TestLongformerConformance(AttentionConformance):
    name = "longformer"
    options = {"window": 4, "dilation": 2, "num_global": 2}


class TestBigBirdConformance(AttentionConformance):
    name = "bigbird"
    options = {"block_size": 2, "num_random": 1, "num_global": 2, "num_window": 3, "seed": 1}


class TestStridedConformance(AttentionConformance):
    name = "strided"
    options = {"stride": 3}


class TestStridedSplitHeadsConformance(AttentionConformance):
    name = "strided"
    options = {"stride": 2, "heads": "split"}


class TestFixedConformance(AttentionConformance):
    name = "fixed"
    options = {"stride": 4, "c": 1}


class TestLocal2DConformance(AttentionConformance):
    name = "local-2d"
    options = {"window": (3, 2)}


class TestLocal2DFixedGridConformance(AttentionConformance):
    name = "local-2d"
    options = {"window": 3, "grid": (3, 3)}
    long_length = None


class TestAxialConformance(AttentionConformance):
    name = "axial"


class TestBPTransformerConformance(AttentionConformance):
    name = "bp-transformer"
    options = {"k": 1}


class TestBlockSparseConformance(AttentionConformance):
    name = "block-sparse"
