"""attnkit plugin hooks: ``adaptive-span``, ``dynamic-span``, ``entmax`` and the ``act`` block (alias ``universal``).

Each spec names its factory and plain reference by import path, so listing
imports no mechanism.
"""

from __future__ import annotations

import dataclasses

import attnkit
from attnkit import AttentionSpec, Capabilities, Paper

from ._checks import MAX_SPAN_LIMIT
from ._half import DTYPES  # float16/bfloat16 inputs compute in float32 inside (_half.py)

ATTNKIT_API_VERSION = 1

_SUKHBAATAR = Paper("Sukhbaatar, Grave, Bojanowski, Joulin", 2019, "Adaptive Attention Span in Transformers",
                    "1905.07799")
_CORREIA = Paper("Correia, Niculae, Martins", 2019, "Adaptively Sparse Transformers", "1909.00015")

_SPAN_CAPS = Capabilities(
    causal=True, noncausal=False, key_padding_mask=True, attn_mask=False, cross=False, causal_cross=False,
    mask_kinds=("causal", "key_padding"), dtypes=DTYPES, backends=("numba", "torch"),
    time="O(L·W·D): numba W = each query's span + ramp; torch W = the largest span + ramp rounded up to a block "
         "(+ one block)",
    memory="numba O(L·D) (tiles per thread, log-sum-exp saved); torch O(L·W) band scores; no L x L matrix",
)

ADAPTIVE_SPAN = AttentionSpec(
    name="adaptive-span",
    factory="attnkit_adaptive.span.module:AdaptiveSpanAttention",
    reference="attnkit_adaptive.span.naive:reference",
    family="adaptive",
    summary="Causal attention under a learned soft span per head, m_z(x) = clamp((R + z - x)/R, 0, 1); "
            "cost follows the spans.",
    paper=_SUKHBAATAR,
    exact=False,
    approximation="softmax weights multiplied by a learned soft distance mask and renormalised: a different "
                  "attention (equal to causal softmax when every span covers the sequence and R -> 0)",
    aux_losses={"span_l1": 2e-6},
    capabilities=dataclasses.replace(_SPAN_CAPS, func_transforms=("grad", "vmap", "jvp"), export=True,
                                     export_masks=None, export_backends=("numba", "torch"),
                                     export_dynamic=("numba", "torch")),
)

DYNAMIC_SPAN = AttentionSpec(
    name="dynamic-span",
    factory="attnkit_adaptive.span.module:DynamicSpanAttention",
    reference="attnkit_adaptive.span.naive:reference",
    family="adaptive",
    summary="Causal attention under a soft span predicted per query, z_t = S·sigmoid(w·q_t + b).",
    paper=_SUKHBAATAR,
    exact=False,
    approximation="softmax weights multiplied by a soft distance mask whose span each query predicts, "
                  "renormalised: a different attention",
    aux_losses={"span_l1": 2e-6},
    capabilities=dataclasses.replace(_SPAN_CAPS, func_transforms=("grad", "jvp"), export=True,
                                     export_masks=None, export_backends=("numba", "torch"),
                                     export_dynamic=("numba", "torch")),
)

ENTMAX = AttentionSpec(
    name="entmax",
    factory="attnkit_adaptive.entmax.module:EntmaxAttention",
    reference="attnkit_adaptive.entmax.naive:reference",
    family="adaptive",
    summary="alpha-entmax in place of softmax, alpha learned per head: sparse weights with exact zeros "
            "(sparsemax at alpha = 2, softmax as alpha -> 1).",
    paper=_CORREIA,
    exact=False,
    approximation="a different normalisation of the scores (alpha-entmax, exact zeros); softmax only as "
                  "alpha -> 1",
    capabilities=Capabilities(
        func_transforms=("vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=True, key_padding_mask=True, attn_mask=True, cross=True, causal_cross=True, positions=True,
        dtypes=DTYPES, backends=("torch",),
        time="O(L·S·(D + n_iter)) (bisection over the dense scores)", memory="O(L·S)",
    ),
)

SPARSE_ADAPTIVE = AttentionSpec(
    name="sparse-adaptive",
    aliases=("sac",),
    factory="attnkit_adaptive.sac.module:SparseAdaptiveAttention",
    reference="attnkit_adaptive.sac.naive:reference",
    family="adaptive",
    summary="Sparse Adaptive Connection (simplified): a learned edge predictor picks num_edges keys per query; "
            "softmax over those edges only.",
    paper=Paper("Li, Meng, Zhou, Han, Wu, Li", 2020,
                "SAC: Accelerating and Structuring Self-Attention via Sparse Adaptive Connection", "2003.09833"),
    exact=False,
    approximation="softmax over the num_edges keys a learned predictor picks per query (plus the predictor's "
                  "score in the logit): a different, sparse attention; the predictor trains through the chosen "
                  "edges instead of REINFORCE (docs/mechanisms/sparse-adaptive.md)",
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        causal=True, key_padding_mask=True, attn_mask=False, cross=True, causal_cross=False,
        mask_kinds=("causal", "key_padding"), dtypes=DTYPES, backends=("torch",),
        time="O(L·S·r) predictor (r = predictor_dim) + O(L·num_edges·D) attention",
        memory="O(chunk_size·S) predictor scores + O(L·num_edges·D) gathered keys",
    ),
)

SPECS = [ADAPTIVE_SPAN, DYNAMIC_SPAN, ENTMAX, SPARSE_ADAPTIVE]

ACT = attnkit.BlockSpec(
    name="act",
    aliases=("universal",),
    factory="attnkit_adaptive.act.module:ACTBlock",
    family="adaptive",
    summary="Universal Transformer block: one shared pre-norm block over depth with ACT halting per position "
            "(threshold 1 - epsilon, remainder, ponder cost N + R), coordinate embeddings of position and step.",
    paper=Paper("Dehghani, Gouws, Vinyals, Uszkoreit, Kaiser", 2019, "Universal Transformers", "1807.03819"),
    aux_losses={"ponder": 0.01},
)
assert MAX_SPAN_LIMIT > 0


@attnkit.hookimpl
def attnkit_register_attention(register):
    """Register the adaptive attentions."""
    for spec in SPECS:
        register(spec)


@attnkit.hookimpl
def attnkit_register_block(register):
    """Register the ACT / Universal Transformer block."""
    register(ACT)
