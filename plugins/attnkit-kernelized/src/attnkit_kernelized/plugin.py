"""attnkit plugin hooks: registers ``linear``, ``performer``, ``rfa`` and ``fast-weight`` (alias ``delta``).

Each spec is the one declaration of its capabilities (the module classes
read theirs from here) and names its factory and plain reference by import
path, so importing this module imports neither numba nor triton (kernels
load on first use). Every backend runs every mode a spec declares: a
forced backend runs or raises, never falls back silently (``torch.func``
transforms excepted: they run the torch path, the kernels being opaque to them).
"""

from __future__ import annotations

import attnkit
from attnkit import AttentionSpec, Capabilities, Paper

ATTNKIT_API_VERSION = 1

_KERNEL_TIME = "O(L·M·E) (M features, E value dim); causal chunked form O(L·(M·E + C·(M + E)))"
_KERNEL_MEMORY = ("causal: O(min(L, 2048)·M) features on CPU, O(min(L, 65536)·M) on CUDA (one segment at a time) "
                  "+ O(M·E) state per head; "
                  "non-causal: O(L·M) features; no L x S matrix")

#: float16/bfloat16 inputs compute in float32 (features, states, normalisers; the triton kernels read half
#: features and values with float32 accumulators and states) and return the output and gradients in the input dtype
HALF_AND_FULL = ("float16", "bfloat16", "float32", "float64")

#: ``auto``'s declared order: numba on CPU; on CUDA the torch forms before the triton kernels. GPU run 5 (an
#: H100, docs/benchmarks.md) timed the torch forms of linear and performer as fast or faster in training than the
#: chunked triton kernels. fast-weight's kernels were 3.1-4.8x its torch form forward+backward (run 5) and causal
#: rfa's chunk-parallel gated kernels 2.8-4.7x (run 6, an H200), so ``FastWeightAttention.backend_order`` and
#: ``RandomFeatureAttention.backend_order`` put triton first on CUDA. ``backend=`` forces any of them.
BACKENDS = ("numba", "torch", "triton")

LINEAR = AttentionSpec(
    name="linear",
    factory="attnkit_kernelized.linear.module:LinearAttention",
    reference="attnkit_kernelized.linear.naive:reference",
    family="kernelized",
    summary="Linear attention phi(q)(phi(k)^T v) with phi(x) = elu(x) + 1 (or relu, softplus, dpfp).",
    paper=Paper("Katharopoulos, Vyas, Pappas, Fleuret", 2020,
                "Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention", "2006.16236"),
    exact=False,
    approximation=("replaces exp(q·k) by a positive feature-map kernel phi(q)·phi(k); a different "
                   "attention, not an estimate of softmax attention (no error bound against it)"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_backends=("numba", "torch"),
        export_dynamic=("numba", "torch"),
        causal=True, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True,
        causal_cross=False, streaming="exact", context_parallel=True, dtypes=HALF_AND_FULL,
        backends=BACKENDS, time=_KERNEL_TIME, memory=_KERNEL_MEMORY,
    ),
)

PERFORMER = AttentionSpec(
    name="performer",
    aliases=("favor",),
    factory="attnkit_kernelized.performer.module:PerformerAttention",
    reference="attnkit_kernelized.performer.naive:reference",
    family="kernelized",
    summary="Performer: FAVOR+ positive orthogonal random features estimating softmax attention.",
    paper=Paper("Choromanski, Likhosherstov, Dohan, Song, Gane, Sarlos, Hawkins, Davis, Mohiuddin, Kaiser, "
                "Belanger, Colwell, Weller", 2021, "Rethinking Attention with Performers", "2009.14794"),
    exact=False,
    approximation=("unbiased random-feature estimate of exp(scale·q·k) with M positive orthogonal random "
                   "features (FAVOR+); the output is a ratio of two such estimates, error ~ 1/sqrt(M) and "
                   "growing like exp(scale·|q + k|^2 / 2): small for small-norm inputs, poor for large ones"),
    # measured worst case over 100 seeds on the kit's distribution (N(0, 1), D=16, L=64, M=256 default):
    # 1.41 non-causal, 0.84 causal; at std 0.5 it is ~0.15 (docs/mechanisms/performer.md)
    error_bound=1.5,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_backends=("numba", "torch"),
        export_dynamic=("numba", "torch"),
        causal=True, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True,
        causal_cross=False, streaming="exact", context_parallel=True, dtypes=HALF_AND_FULL,
        backends=BACKENDS, time=_KERNEL_TIME, memory=_KERNEL_MEMORY,
    ),
)

RFA = AttentionSpec(
    name="rfa",
    factory="attnkit_kernelized.rfa.module:RandomFeatureAttention",
    reference="attnkit_kernelized.rfa.naive:reference",
    family="kernelized",
    summary="Random feature attention; causal form gated: S_t = g S_{t-1} + (1 - g) phi(k_t) v_t^T.",
    paper=Paper("Peng, Pappas, Yogatama, Schwartz, Smith, Kong", 2021, "Random Feature Attention",
                "2103.02143"),
    exact=False,
    approximation=("random Fourier features of l2-normalised q and k (Gaussian kernel with learned width); "
                   "the causal form adds a learned recency gate, so it is not an estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_backends=("numba", "torch"),
        export_dynamic=("numba", "torch"),
        causal=True, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True,
        causal_cross=False, streaming="exact", context_parallel=True, dtypes=HALF_AND_FULL,
        backends=BACKENDS, time=_KERNEL_TIME, memory=_KERNEL_MEMORY,
    ),
)

FAST_WEIGHT = AttentionSpec(
    name="fast-weight",
    aliases=("delta",),
    factory="attnkit_kernelized.fast_weight.module:FastWeightAttention",
    reference="attnkit_kernelized.fast_weight.naive:reference",
    family="kernelized",
    summary="Delta-rule fast weight memory (write and remove): S_t = S_{t-1} + beta_t phi(k_t)(v_t - S^T phi(k_t))^T.",
    paper=Paper("Schlag, Irie, Schmidhuber", 2021, "Linear Transformers Are Secretly Fast Weight Programmers",
                "2102.11174"),
    exact=False,
    approximation=("a recurrent fast-weight memory with the delta update rule and DPFP features; a different "
                   "sequence model, not an estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_backends=("numba", "torch"),
        export_dynamic=("numba",),
        causal=True, noncausal=False, key_padding_mask=True, attn_mask=False, cross=False,
        causal_cross=False, streaming="exact", context_parallel=True, dtypes=HALF_AND_FULL,
        backends=BACKENDS, time="O(L·M·E)",
        memory="O(min(L, 2048)·M) features on CPU, O(min(L, 65536)·M) on CUDA (one segment at a time) "
               "+ O(M·E) state per head",
    ),
)

SPECS = (LINEAR, PERFORMER, RFA, FAST_WEIGHT)


@attnkit.hookimpl
def attnkit_register_attention(register):
    """Register the four kernelized attentions."""
    for spec in SPECS:
        register(spec)
