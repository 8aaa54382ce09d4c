"""attnkit plugin hooks: registers ``nystrom``, ``linformer``, ``soft``, ``memory-compressed``,
``informer``, ``clustered``, ``improved-clustered``, ``isab``, ``luna`` and ``poolingformer``.

Each spec is the one declaration of its capabilities (the module classes read
theirs from here) and names its factory and plain reference by import path, so
listing the registry imports none of the modules. Every mechanism here is a
chain of dense matrix products on ``torch`` (one backend): no kernel would beat
the BLAS these products already run on.
"""

from __future__ import annotations

import attnkit
from attnkit import AttentionSpec, Capabilities, Paper

ATTNKIT_API_VERSION = 1

#: float16/bfloat16 inputs run the float32 code (q, k, v upcast at the module boundary, the output cast back:
#: output and input gradients in the input dtype; states stay float32): see ``common.Float32Inside``
HALF_AND_FULL = ("float16", "bfloat16", "float32", "float64")

NYSTROM = AttentionSpec(
    name="nystrom",
    aliases=("nystromformer",),
    factory="attnkit_lowrank.nystrom.module:NystromAttention",
    reference="attnkit_lowrank.nystrom.naive:reference",
    family="lowrank",
    summary=("Nystromformer: softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V with m segment-mean "
             "landmarks and an iterative pseudo-inverse (optional depthwise-conv residual on V)."),
    paper=Paper("Xiong, Zeng, Chakraborty, Tan, Fung, Li, Singh", 2021,
                "Nystromformer: A Nystrom-Based Algorithm for Approximating Self-Attention", "2102.03902"),
    exact=False,
    approximation=("Nystrom approximation of the softmax matrix from m landmarks (segment means of queries and of "
                   "the real keys); exact when every token is its own landmark and the pseudo-inverse converged"),
    # no bound: on unstructured inputs its error is that of mean(V) until m nears L (docs/lowrank.md)
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=False, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("key_padding",), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        queries_interact=True,
        time="O((L + S)·m·D + m^3·iterations)", memory="O((L + S)·m + m^2) per head; no L x S matrix",
    ),
)

LINFORMER = AttentionSpec(
    name="linformer",
    factory="attnkit_lowrank.linformer.module:LinformerAttention",
    reference="attnkit_lowrank.linformer.naive:reference",
    family="lowrank",
    summary=("Linformer: keys and values projected along the length by learned E, F (proj_len x max_length), "
             "softmax(Q (E K)^T) (F V); shared or per-head projections, optional E = F."),
    paper=Paper("Wang, Li, Khabsa, Fang, Ma", 2020, "Linformer: Self-Attention with Linear Complexity",
                "2006.04768"),
    exact=False,
    approximation=("softmax over proj_len learned linear combinations of the keys (and values): a different "
                   "attention with learned projections, not an estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=False, noncausal=True, key_padding_mask=False, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=(), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        time="O((L + S)·proj_len·D)", memory="O(L·proj_len) per head + proj_len x max_length parameters",
    ),
)

SOFT = AttentionSpec(
    name="soft",
    factory="attnkit_lowrank.soft.module:SoftAttention",
    reference="attnkit_lowrank.soft.naive:reference",
    family="lowrank",
    summary=("SOFT: softmax-free Gaussian-kernel attention exp(-scale/2 |q - k|^2), approximated as "
             "P A^+ P^T V from bottleneck tokens (strided conv or average pooling) with a Newton-Raphson "
             "Moore-Penrose inverse."),
    paper=Paper("Lu, Yao, Zhang, Zhu, Xu, Gao, Xiang, Xiang, Zhang", 2021,
                "SOFT: Softmax-free Transformer with Linear Complexity", "2110.11945"),
    exact=False,
    approximation=("a softmax-free Gaussian-kernel attention (no normalisation), itself approximated by a Nystrom "
                   "factorisation through bottleneck tokens: not an estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=False, noncausal=True, key_padding_mask=False, attn_mask=False, cross=False, causal_cross=False,
        mask_kinds=(), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        shared_qk=True,      # the paper's shared Q/K projection: MultiHeadAttention passes k = q
        time="O(L·m·D + m^3·iterations), m = ceil(L / stride)",
        memory="O(L·m + m^2) per head; no L x L matrix",
    ),
)

MCA = AttentionSpec(
    name="memory-compressed",
    aliases=("mca",),
    factory="attnkit_lowrank.mca.module:MemoryCompressedAttention",
    reference="attnkit_lowrank.mca.naive:reference",
    family="lowrank",
    summary=("Memory-compressed attention: softmax attention over keys and values shortened by a strided "
             "convolution (kernel = stride = 3); causal form sees only windows wholly in the past."),
    paper=Paper("Liu, Saleh, Pot, Goodrich, Sepassi, Kaiser, Shazeer", 2018,
                "Generating Wikipedia by Summarizing Long Sequences", "1801.10198"),
    exact=False,
    approximation=("softmax attention over ceil(S / stride) learned summaries of the keys and values: a different "
                   "attention, not an estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=True, noncausal=True, key_padding_mask=False, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("causal",), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        time="O(L·S/stride·D + S·D^2)", memory="O(L·S/stride) per head",
    ),
)

INFORMER = AttentionSpec(
    name="informer",
    aliases=("probsparse",),
    factory="attnkit_lowrank.informer.module:InformerAttention",
    reference="attnkit_lowrank.informer.naive:reference",
    family="lowrank",
    summary=("Informer ProbSparse attention: the u = c·ln L queries with the largest sampled max-minus-mean "
             "score attend fully, the others output mean(V); causal form: online top-u over the past, "
             "masked attention, lazy queries take the cumulative mean of V."),
    paper=Paper("Zhou, Zhang, Peng, Zhang, Li, Xiong, Zhang", 2021,
                "Informer: Beyond Efficient Transformer for Long Sequence Time-Series Forecasting", "2012.07436"),
    exact=False,
    approximation=("only the top-u queries by a sampled sparsity measure attend exactly; the rest output mean(V). "
                   "Exact when u >= L"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "jvp"), export=True,
        causal=True, noncausal=True, key_padding_mask=False, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("causal",), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        queries_interact=True,
        time="O(L·ln S·D + ln L·S·D); causal O(L·ln L·D + n·L·D), n ≈ u·(1 + ln(L/u)) active queries",
        memory="O(chunk·ln S·D + ln L·S) per head; causal O(n·L)",
    ),
)

_VYAS = Paper("Vyas, Katharopoulos, Fleuret", 2020, "Fast Transformers with Clustered Attention", "2007.04825")

CLUSTERED = AttentionSpec(
    name="clustered",
    factory="attnkit_lowrank.clustered.module:ClusteredAttention",
    reference="attnkit_lowrank.clustered.naive:reference",
    family="lowrank",
    summary=("Clustered attention: queries grouped by LSH codes + Hamming K-means into C clusters; each "
             "centroid attends and its members share the output."),
    paper=_VYAS,
    exact=False,
    approximation=("every query receives its cluster centroid's softmax attention; exact with one query per "
                   "cluster"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "jvp"), export=True,
        causal=False, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("key_padding",), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        queries_interact=True,
        time="O(L·bits·(D + C·iterations) + C·S·D)", memory="O(L·C + C·S) per head",
    ),
)

IMPROVED_CLUSTERED = AttentionSpec(
    name="improved-clustered",
    aliases=("i-clustered",),
    factory="attnkit_lowrank.clustered.module:ImprovedClusteredAttention",
    reference="attnkit_lowrank.clustered.naive:reference",
    family="lowrank",
    summary=("Improved clustered attention: clustered attention, plus each query's exact softmax over its "
             "cluster's top-k keys (scaled by the centroid's weight on them)."),
    paper=_VYAS,
    exact=False,
    approximation=("exact per-query softmax over each cluster's top-k keys, the centroid's weights elsewhere; "
                   "exact with one query per cluster"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "jvp"), export=True,
        causal=False, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("key_padding",), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        queries_interact=True,
        time="O(L·bits·(D + C·iterations) + C·S·D + L·top_k·D)", memory="O(L·(C + top_k) + C·S) per head",
    ),
)

ISAB = AttentionSpec(
    name="isab",
    factory="attnkit_lowrank.isab.module:InducedAttention",
    reference="attnkit_lowrank.isab.naive:reference",
    family="lowrank",
    summary=("Induced set attention (Set Transformer): m learned inducing points attend to the keys, the "
             "queries attend to the packed keys and values."),
    paper=Paper("Lee, Lee, Kim, Kosiorek, Choi, Teh", 2019,
                "Set Transformer: A Framework for Attention-based Permutation-Invariant Neural Networks",
                "1810.00825"),
    exact=False,
    approximation=("attention through m learned inducing points (a rank-m bottleneck): a different attention, "
                   "not an estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=False, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("key_padding",), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        time="O((L + S)·m·D)", memory="O((L + S)·m) per head",
    ),
)

LUNA = AttentionSpec(
    name="luna",
    factory="attnkit_lowrank.luna.module:LunaAttention",
    reference="attnkit_lowrank.luna.naive:reference",
    family="lowrank",
    summary=("Luna: a packed sequence P of packed_len vectors packs the keys (P' = Attn(P, X)), the queries "
             "unpack it (Y = Attn(X, P')); the next packed sequence LayerNorm(P + K_p) is returned as state."),
    paper=Paper("Ma, Kong, Wang, Zhou, May, Ma, Zettlemoyer", 2021, "Luna: Linear Unified Nested Attention",
                "2106.01540"),
    exact=False,
    approximation=("attention through m packed vectors (a rank-m bottleneck): a different attention, not an "
                   "estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=True, noncausal=True, key_padding_mask=True, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("causal", "key_padding"), streaming="segment", dtypes=HALF_AND_FULL,
        backends=("torch",),
        time="O((L + S)·m·D); causal O(L·chunk·m·(D + E))", memory="O((L + S)·m) per head",
    ),
)

POOLINGFORMER = AttentionSpec(
    name="poolingformer",
    factory="attnkit_lowrank.poolingformer.module:PoolingformerAttention",
    reference="attnkit_lowrank.poolingformer.naive:reference",
    family="lowrank",
    summary=("Poolingformer: a sliding-window softmax plus a softmax over mean-pooled keys and values in a larger "
             "window, the two outputs summed."),
    paper=Paper("Zhang, Gong, Shen, Li, Lv, Duan, Chen", 2021,
                "Poolingformer: Long Document Modeling with Pooling Attention", "2105.04371"),
    exact=False,
    approximation=("a sliding window plus pooled segments of a larger window, two softmaxes summed: a different "
                   "attention, not an estimate of softmax attention"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        export_masks=(),   # key padding: the pooled segments are those of each row's kept keys (from the data)
        causal=True, noncausal=True, key_padding_mask=True, attn_mask=False, cross=False, causal_cross=False,
        mask_kinds=("causal", "key_padding"), streaming=None, dtypes=HALF_AND_FULL, backends=("torch",),
        time="O(L·(window + pool_window / pool_stride)·D)", memory="O(L·(window + pool_window / pool_stride))",
    ),
)

SPECS = (NYSTROM, LINFORMER, SOFT, MCA, INFORMER, CLUSTERED, IMPROVED_CLUSTERED, ISAB, LUNA, POOLINGFORMER)


@attnkit.hookimpl
def attnkit_register_attention(register):
    """Register the low-rank attentions."""
    for spec in SPECS:
        register(spec)
