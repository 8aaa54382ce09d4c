"""The attnkit conformance kit on every registered name: one thin subclass per configuration.

The kit holds the torch path to each spec's own plain reference
(``attnkit_lowrank.<mechanism>.naive:reference``) in float64, outputs and
gradients, and checks refusals, padding, empty sequences, gradients and
serialisation. Options keep the landmark counts within the kit's lengths
(L = 9, S = 12, padded rows with 6 real keys).
"""

from __future__ import annotations

from attnkit.testing import AttentionConformance

#: linformer in half: the kit casts the module (``.to(dtype)``), so its learned projections E, F are rounded to the
#: half dtype while the reference reads the float64 module's unrounded ones, and the values F V are sums of S
#: values with random weights (not averages: entries up to ~3 at S = 67), so output rounding is larger in absolute
#: terms too. Measured max |diff| at S = 67: float16 0.008-0.010, bfloat16 0.047-0.065 (a float32 module on the
#: same inputs: 0.004 and 0.03, rounding of the output alone). These tolerances cover the rounded parameters;
#: tests/test_half.py holds half modules to the reference on their own (rounded) parameters at the kit's defaults.
LINFORMER_HALF_TOL = {"float16": 1.5e-2, "bfloat16": 5e-2}

#: float16/bfloat16 run the float32 code on upcast inputs (common.Float32Inside), so a second configuration of a
#: spec adds nothing in half that its float32 run and the spec's other class in half do not hold; the two slowest
#: such classes test float32/float64 only (their half runs cost ~7 s of CI: 13.8 and 10.2 s against 8.6 and 8.2)
FULL_ONLY = ("float32", "float64")


class TestNystromConformance(AttentionConformance):
    name = "nystrom"
    options = {"num_landmarks": 3}


class TestNystromConvConformance(AttentionConformance):
    name = "nystrom"
    options = {"num_landmarks": 4, "pinv_iterations": 3, "conv_kernel_size": 3}
    skip = {"key_padding": ("the convolution residual reads neighbouring positions, so a padded key is a zero "
                            "value there rather than absent (the attention part holds it: the class above)")}


class TestLinformerConformance(AttentionConformance):
    name = "linformer"
    options = {"proj_len": 5, "max_length": 128}
    atol = rtol = LINFORMER_HALF_TOL


class TestLinformerPerHeadSharedConformance(AttentionConformance):
    name = "linformer"
    options = {"proj_len": 4, "max_length": 80, "per_head": True, "share_kv": True}
    atol = rtol = LINFORMER_HALF_TOL


class TestSoftConvConformance(AttentionConformance):
    name = "soft"
    options = {"stride": 3}


class TestSoftPoolConformance(AttentionConformance):
    name = "soft"
    options = {"stride": 4, "bottleneck": "pool", "pinv_iterations": 8}


class TestMemoryCompressedConformance(AttentionConformance):
    """Defaults, as a bare `attnkit check memory-compressed` runs them (the kit hints value_dim = E)."""

    name = "memory-compressed"


class TestMcaPoolConformance(AttentionConformance):
    name = "mca"
    options = {"stride": 2, "compression": "pool"}


class TestInformerConformance(AttentionConformance):
    name = "informer"
    options = {"factor": 1}


class TestProbsparseAllActiveConformance(AttentionConformance):
    name = "probsparse"
    options = {"factor": 50}     # u >= L: every query active


class TestClusteredConformance(AttentionConformance):
    name = "clustered"
    options = {"clusters": 3, "bits": 8, "iterations": 3}


class TestImprovedClusteredConformance(AttentionConformance):
    name = "improved-clustered"
    options = {"clusters": 3, "bits": 8, "iterations": 3, "top_k": 3}


class TestIsabConformance(AttentionConformance):
    name = "isab"
    options = {"num_inducing": 4}


class TestIsabPerHeadConformance(AttentionConformance):
    name = "isab"
    options = {"num_inducing": 3, "per_head": True}


class TestNystromDefaultConformance(AttentionConformance):
    """Defaults as `attnkit check nystrom` runs them: 64 landmarks capped at the kit's short lengths."""

    name = "nystrom"


class TestSoftDefaultConformance(AttentionConformance):
    """Defaults: stride 64 on the kit's 9- to 67-token sequences (one or two zero-filled windows)."""

    name = "soft"


class TestClusteredDefaultConformance(AttentionConformance):
    name = "improved-clustered"      # 100 clusters and top-32 capped at L and S
    dtypes_to_test = FULL_ONLY      # half: TestImprovedClusteredConformance


class TestInformerCausalSmallFactorConformance(AttentionConformance):
    """factor 1: u = ceil(ln L) of the kit's 9-67 queries, so the causal online top-u leaves lazy rows."""

    name = "informer"
    options = {"factor": 1, "chunk_size": 4}     # several chunks of the online top-u


class TestLunaConformance(AttentionConformance):
    name = "luna"
    options = {"packed_len": 4}


class TestLunaPerHeadChunkedConformance(AttentionConformance):
    name = "luna"
    options = {"packed_len": 3, "per_head": True, "chunk_size": 2}   # several causal chunks per sequence
    dtypes_to_test = FULL_ONLY      # half: TestLunaConformance


class TestLunaPrefixSoftmaxConformance(AttentionConformance):
    """The non-default causal form (the paper's is the default, in the two classes above)."""

    name = "luna"
    options = {"packed_len": 3, "chunk_size": 4, "causal_form": "prefix-softmax"}


class TestPoolingformerConformance(AttentionConformance):
    """Defaults (window 128, pool window 512): on the kit's short lengths both windows cover everything."""

    name = "poolingformer"


class TestPoolingformerSmallWindowsConformance(AttentionConformance):
    name = "poolingformer"
    options = {"window": 4, "pool_window": 6, "pool_size": 3, "pool_stride": 2, "chunk_size": 3}


class TestPoolingformerDisjointSegmentsConformance(AttentionConformance):
    name = "poolingformer"
    options = {"window": 2, "pool_window": 8, "pool_size": 4, "pool_stride": 4, "chunk_size": 5}
