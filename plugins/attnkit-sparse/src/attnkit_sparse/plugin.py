"""attnkit plugin hooks: the sparse patterns (position-based, and content-based ``lsh``), all on one engine.

Each spec names its factory and its plain reference by import path, so
listing imports no pattern, engine or kernel code. Every pattern is a mask
object (:mod:`attnkit_sparse.patterns`); the engine
(:func:`attnkit_sparse.engine.attend`) executes ``pattern & <the caller's
mask>`` from its block index, so every pattern honours causal (where it has
a causal form), key padding, documents, windows, mask functions, unions and
bool ``attn_mask`` tensors. An additive float ``attn_mask`` (a bias) is not
a sparsity pattern: it is honoured exactly on the dense masked-softmax path
(O(L·S), like SDPA).
"""

from __future__ import annotations

import attnkit
from attnkit import AttentionSpec, Capabilities, Paper

ATTNKIT_API_VERSION = 1

#: in order of preference: triton, then FlexAttention on CUDA (measured, engine.BACKENDS), numba on CPU, torch
BACKENDS = ("triton", "flex", "numba", "torch")
_KINDS = ("causal", "key_padding", "tensor", "sliding_window", "document", "function", "union")
#: every sparse module takes half precision: triton and flex run float16/bfloat16 operands as they are (float32
#: softmax statistics); numba upcasts to float32 and casts the output and gradients back; torch computes scores,
#: softmax and accumulation in float32 (docs/sparse-engine.md, "Dtypes")
HALF_AND_FULL = ("float16", "bfloat16", "float32", "float64")
_MEMORY = "O(attended tiles) block index + O(L·E) output; no L x S matrix (additive bias: dense path)"

_PARMAR = Paper("Parmar, Vaswani, Uszkoreit, Kaiser, Shazeer, Ku, Tran", 2018, "Image Transformer", "1802.05751")
_LONGFORMER = Paper("Beltagy, Peters, Cohan", 2020, "Longformer: The Long-Document Transformer", "2004.05150")
_BIGBIRD = Paper("Zaheer, Guruganesh, Dubey, Ainslie, Alberti, Ontanon, Pham, Ravula, Wang, Yang, Ahmed", 2020,
                 "Big Bird: Transformers for Longer Sequences", "2007.14062")
_CHILD = Paper("Child, Gray, Radford, Sutskever", 2019, "Generating Long Sequences with Sparse Transformers",
               "1904.10509")


def _caps(*, causal: bool = True, cross: bool = True, streaming: str | None = None, time: str,
          context_parallel: bool = False, banded: bool = False) -> Capabilities:
    # banded: the pattern's pairs lie in a finite position band, with global keys and queries apart, so a program
    # with a dynamic length attends within it (engine/dynamic.py); every other pattern's block plan fixes the
    # length of a program
    return Capabilities(
        causal=causal, noncausal=True, key_padding_mask=True, attn_mask=True, cross=cross,
        causal_cross=causal and cross, streaming=streaming, positions=True, context_parallel=context_parallel,
        mask_kinds=_KINDS if causal else tuple(k for k in _KINDS if k != "causal"),
        dtypes=HALF_AND_FULL, backends=BACKENDS, time=time, memory=_MEMORY, func_transforms=("grad", "vmap", "jvp"),
        export=True, export_backends=("numba", "torch"),   # numba: custom operators (the plugin imported to load)
        export_dynamic=("numba", "torch") if banded else (),
    )


def _spec(name: str, cls: str, module: str, summary: str, paper: Paper | None, caps: Capabilities, *,
          aliases: tuple[str, ...] = (), exact: bool = False) -> AttentionSpec:
    return AttentionSpec(
        name=name, aliases=aliases, factory=f"attnkit_sparse.patterns.{module}:{cls}",
        reference="attnkit_sparse.naive:reference", family="sparse", summary=summary, paper=paper, exact=exact,
        approximation="" if exact else ("softmax attention restricted to the pattern's (query, key) pairs: exact "
                                        "softmax over those pairs, a different attention from full softmax"),
        error_bound=None, capabilities=caps,
    )


LOCAL = _spec("local", "LocalAttention", "local",
              "Sliding window: each query sees `window` keys, itself included (causal: itself and the window - 1 "
              "before).", _PARMAR, _caps(streaming="exact", time="O(L·window·D)", context_parallel=True, banded=True),
              aliases=("sliding-window", "band"))
DILATED = _spec("dilated", "DilatedAttention", "local",
                "Dilated window: `window` keys `dilation` apart, itself included; per-head dilations allowed.",
                _LONGFORMER, _caps(streaming="exact", time="O(L·window·D)", banded=True))
BLOCK_LOCAL = _spec("block-local", "BlockLocalAttention", "local",
                    "Non-overlapping blocks of `block_size` positions attend within themselves (optionally also "
                    "the previous block).", _PARMAR, _caps(time="O(L·block_size·D)", banded=True))
GLOBAL = _spec("global", "GlobalAttention", "global_",
               "Local window plus global tokens that see every key and are seen by every query.",
               Paper("Ainslie, Ontanon, Alberti, Cvicek, Fisher, Pham, Ravula, Sanghai, Wang, Yang", 2020,
                     "ETC: Encoding Long and Structured Inputs in Transformers", "2004.08483"),
               _caps(time="O(L·(window + G)·D + G·S·D)", banded=True))
RANDOM = _spec("random", "RandomAttention", "random_",
               "Each query block sees `num_random` random key blocks, reproducible from `seed` (per head optional).",
               _BIGBIRD, _caps(time="O(L·num_random·block_size·D)"))
LONGFORMER = _spec("longformer", "LongformerAttention", "global_",
                   "Longformer: (dilated) sliding window of w/2 keys per side plus global tokens (w = 512, the "
                   "first token global).", _LONGFORMER, _caps(time="O(L·(window + G)·D + G·S·D)", banded=True))
BIGBIRD = _spec("bigbird", "BigBirdAttention", "random_",
                "BigBird-ITC on blocks: window blocks + global blocks (first and last) + random blocks; no causal "
                "form.", _BIGBIRD, _caps(causal=False, time="O(L·(w + g + r)·block_size·D)"))
STRIDED = _spec("strided", "StridedAttention", "sparse_transformer",
                "Sparse Transformer strided pattern: the `stride` previous positions and every `stride`-th one "
                "(merged in every head, or split across heads).", _CHILD,
                _caps(streaming="exact", time="O(L·(stride + L/stride)·D)"))
FIXED = _spec("fixed", "FixedAttention", "sparse_transformer",
              "Sparse Transformer fixed pattern: its block of `stride` and the last `c` positions of every block "
              "(merged in every head, or split across heads).", _CHILD,
              _caps(streaming="exact", time="O(L·(stride + c·L/stride)·D)"))
LOCAL_2D = _spec("local-2d", "Local2DAttention", "grid",
                 "2-D local window over an image grid (raster order; causal form: rows above and the left part of "
                 "its own row).", _PARMAR, _caps(cross=False, time="O(L·window_rows·window_cols·D)"))
AXIAL = _spec("axial", "AxialAttention", "grid",
              "Axial attention over a 2-D grid: its row and its column (union in one softmax, or one axis).",
              Paper("Ho, Kalchbrenner, Weissenborn, Salimans", 2019, "Axial Attention in Multidimensional "
                    "Transformers", "1912.12180"), _caps(cross=False, time="O(L·(rows + cols)·D)"))
BP_TRANSFORMER = _spec("bp-transformer", "BPTransformerAttention", "bp",
                       "BP-Transformer's binary-partition pattern on tokens: k neighbours per side at each level, "
                       "fine near and coarse far (span nodes not modelled).",
                       Paper("Ye, Guo, Gan, Qiu, Zhang", 2019, "BP-Transformer: Modelling Long-Range Context via "
                             "Binary Partitioning", "1911.04070"), _caps(time="O(L·k·log(L)·D)"))
BLOCK_SPARSE = _spec("block-sparse", "BlockSparseAttention", "block_sparse",
                     "Runs the caller's mask object (any mask function) on the block-sparse engine; exact softmax "
                     "over the pairs it allows.",
                     Paper("Dong, Feng, Guessous, Liang, He", 2024, "Flex Attention: A Programming Model for "
                           "Generating Optimized Attention Kernels", "2412.05496"),
                     _caps(time="O(attended tiles·block²·D)"), exact=True)

_KITAEV = Paper("Kitaev, Kaiser, Levskaya", 2020, "Reformer: The Efficient Transformer", "2001.04451")

#: content-based mechanisms: the sequence is reordered from the data, the engine runs an explicit plan
#: (attnkit_sparse.engine.attend_plan: torch, numba and triton return the log-sum-exp the rounds are combined
#: with). Declared order numba, torch, triton; the modules' ``backend_order`` puts triton first for half inputs
#: on CUDA, where an H100 measured it faster than torch (base.content_backend_order)
CONTENT_BACKENDS = ("numba", "torch", "triton")

LSH = AttentionSpec(
    name="lsh", aliases=("reformer",), factory="attnkit_sparse.lsh.attention:LSHAttention",
    reference="attnkit_sparse.lsh.naive:reference", family="sparse",
    summary="Reformer LSH attention, shared-QK: random-rotation hashes, n_hashes rounds sorted by bucket, each "
            "position attends its chunk and the previous one (never itself unless alone), rounds combined by "
            "log-sum-exp.",
    paper=_KITAEV, exact=False,
    approximation="softmax over the keys that share a sorted chunk (or the previous one) in some hash round; "
                  "keys are unit vectors (shared-QK)",
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "jvp"), export=True,
        export_masks=(),   # the bucket / cluster counts follow each sequence's real length (read from the mask)
        causal=True, noncausal=True, key_padding_mask=True, attn_mask=False, cross=False, causal_cross=False,
        mask_kinds=("causal", "key_padding"), positions=False, dtypes=HALF_AND_FULL,
        backends=CONTENT_BACKENDS, shared_qk=True, queries_interact=True, selection_sees_future=True,
        time="O(n_hashes·L·bucket_size·D)",
        memory="O(n_hashes·L·(D + E + bucket_size)): sorted copies and the chunks' element masks; no L x S matrix",
    ),
)

ROUTING = AttentionSpec(
    name="routing", factory="attnkit_sparse.routing.attention:RoutingAttention",
    reference="attnkit_sparse.routing.naive:reference", family="sparse",
    summary="Routing Transformer: online k-means centroids (EMA in training) in the shared unit q/k space; each "
            "cluster routes its top-w queries and keys and attends within; commitment auxiliary loss.",
    paper=Paper("Roy, Saffar, Vaswani, Grangier", 2021, "Efficient Content-Based Sparse Attention with Routing "
                "Transformers", "2003.05997"),
    exact=False,
    approximation="softmax over the keys routed to the same cluster(s) as the query; unrouted queries give 0",
    error_bound=None, aux_losses={"routing_commitment": 1e-4},
    capabilities=Capabilities(
        func_transforms=("grad", "jvp"), export=True,
        export_masks=(),   # the bucket / cluster counts follow each sequence's real length (read from the mask)
        causal=True, noncausal=True, key_padding_mask=True, attn_mask=False, cross=False, causal_cross=False,
        mask_kinds=("causal", "key_padding"), positions=False, dtypes=HALF_AND_FULL,
        backends=CONTENT_BACKENDS, queries_interact=True, selection_sees_future=True,
        time="O(L·(L/num_clusters)·D + L·num_clusters·D)",
        memory="O(L·(D + E) + num_clusters·w²) with w = L/num_clusters; no L x S matrix",
    ),
)

SINKHORN = AttentionSpec(
    name="sinkhorn", factory="attnkit_sparse.sinkhorn.attention:SinkhornAttention",
    reference="attnkit_sparse.sinkhorn.naive:reference", family="sparse",
    summary="Sparse Sinkhorn attention: a learned sorting network and Gumbel-Sinkhorn give a soft block "
            "permutation; each query block attends its own block and its sorted key block.",
    paper=Paper("Tay, Bahri, Yang, Metzler, Juan", 2020, "Sparse Sinkhorn Attention", "2002.11296"),
    exact=False,
    approximation="softmax over the query's own block and one sorted (mixed) key block",
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True,
        causal=True, noncausal=True, key_padding_mask=False, attn_mask=False, cross=False, causal_cross=False,
        mask_kinds=("causal",), positions=False, dtypes=HALF_AND_FULL, backends=CONTENT_BACKENDS,
        time="O(L·2·block_size·D + (L/block_size)²·D)",
        memory="O(L·(D + E)) sorted copies + O((L/block_size)²) sorting matrix; no L x S matrix",
    ),
)

SPECS = (LOCAL, DILATED, BLOCK_LOCAL, GLOBAL, RANDOM, LONGFORMER, BIGBIRD, STRIDED, FIXED, LOCAL_2D, AXIAL,
         BP_TRANSFORMER, BLOCK_SPARSE, LSH, ROUTING, SINKHORN)


@attnkit.hookimpl
def attnkit_register_attention(register):
    """Register the position-based sparse patterns."""
    for spec in SPECS:
        register(spec)
