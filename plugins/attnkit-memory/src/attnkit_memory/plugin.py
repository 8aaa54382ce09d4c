"""attnkit plugin hooks: attentions ``transformer-xl``, ``compressive``, ``memory-tokens``; the block ``gtrxl``.

Each spec is the one declaration of its capabilities and names its factory and
plain reference by import path (importing this module imports no mechanism).
"""

from __future__ import annotations

import attnkit
from attnkit import AttentionSpec, BlockSpec, Capabilities, Paper

ATTNKIT_API_VERSION = 1

#: float16/bfloat16 inputs run the float32 code (q, k, v upcast at the module boundary, the output cast back:
#: output and input gradients in the input dtype; states stay float32): see ``common.Float32Inside``
HALF_AND_FULL = ("float16", "bfloat16", "float32", "float64")

_MEMORY_CAPS = dict(
    causal=True, noncausal=False, key_padding_mask=True, attn_mask=False, cross=False, causal_cross=True,
    streaming="segment", state_detached=False, positions=False, dtypes=HALF_AND_FULL,
)

TRANSFORMER_XL = AttentionSpec(
    name="transformer-xl",
    aliases=("txl",),
    factory="attnkit_memory.transformer_xl.module:TransformerXLAttention",
    reference="attnkit_memory.transformer_xl.naive:reference",
    family="memory",
    summary=("Transformer-XL: a memory of the previous segments' keys/values (mem_len) and relative "
             "positional attention (content, position, u and v terms; sinusoidal encodings)."),
    paper=Paper("Dai, Yang, Yang, Carbonell, Le, Salakhutdinov", 2019,
                "Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context", "1901.02860"),
    exact=False,
    approximation=("a different attention, not an estimate of softmax: relative position terms and learned "
                   "biases u, v are added to the scores, and keys beyond the memory are not seen"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_backends=("sdpa", "torch"),
        export_dynamic=("sdpa", "torch"), **_MEMORY_CAPS, backends=("sdpa", "torch"),
        time="O(L·(M + S)·D) per segment",
        memory="O(L·(M + S)) scores per head (the shift is a view) + O(M·(D + E)) memory per head",
    ),
)

COMPRESSIVE = AttentionSpec(
    name="compressive",
    factory="attnkit_memory.compressive.module:CompressiveAttention",
    reference="attnkit_memory.transformer_xl.naive:reference",
    family="memory",
    summary=("Compressive Transformer: Transformer-XL memory plus a compressed memory (cmem_len) filled from "
             "evicted memories at rate c (max/mean pooling, 1D convolution or most-used)."),
    paper=Paper("Rae, Potapenko, Jayakumar, Hillier, Lillicrap", 2020,
                "Compressive Transformers for Long-Range Sequence Modelling", "1911.05507"),
    exact=False,
    approximation=("Transformer-XL attention over compressed memory + memory + segment; compressed slots "
                   "summarise c evicted positions each"),
    error_bound=None,
    aux_losses={"attention_reconstruction": 1.0},
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_backends=("sdpa", "torch"),
        export_dynamic=("sdpa", "torch"), **_MEMORY_CAPS, backends=("sdpa", "torch"),
        time="O(L·(Mc + M + S)·D) per segment",
        memory="O(L·(Mc + M + S)) scores per head + O((Mc + M)·(D + E)) memory per head",
    ),
)

MEMORY_TOKENS = AttentionSpec(
    name="memory-tokens",
    aliases=("rmt",),
    factory="attnkit_memory.memory_tokens.module:MemoryTokenAttention",
    reference="attnkit_memory.memory_tokens.naive:reference",
    family="memory",
    summary=("Recurrent memory slots (after RMT): num_memory slots prepended to every segment's keys, read by "
             "its queries and written by the slots' own attention over memory + segment, carried across segments."),
    paper=Paper("Bulatov, Kuratov, Burtsev", 2022, "Recurrent Memory Transformer", "2207.06881"),
    exact=False,
    approximation=("softmax attention over learned, recurrently rewritten memory slots plus the segment; the "
                   "attention-level form of RMT (each layer keeps its own slots)"),
    error_bound=None,
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_dynamic=("torch",),
        **_MEMORY_CAPS, backends=("torch",),
        time="O((L + N)·(N + S)·D) per segment",
        memory="O((L + N)·(N + S)) scores per head + O(N·(D + E)) memory per head",
    ),
)

GTRXL = BlockSpec(
    name="gtrxl",
    factory="attnkit_memory.gtrxl.block:GatedTransformerBlock",
    family="memory",
    summary=("GTrXL block: layer norm on each sub-layer's input and GRU-type gates in place of the residual "
             "connections, initialised near the identity (gate bias > 0)."),
    paper=Paper("Parisotto, Song, Rae, Pascanu, Gulcehre, Jayakumar, Jaderberg, Lopez Kaufman, Clark, Noury, "
                "Botvinick, Heess, Hadsell", 2020, "Stabilizing Transformers for Reinforcement Learning",
                "1910.06764"),
    streaming="segment",
)

SPECS = (TRANSFORMER_XL, COMPRESSIVE, MEMORY_TOKENS)


@attnkit.hookimpl
def attnkit_register_attention(register):
    """Register ``transformer-xl``, ``compressive`` and ``memory-tokens``."""
    for spec in SPECS:
        register(spec)


@attnkit.hookimpl
def attnkit_register_block(register):
    """Register the ``gtrxl`` gated block."""
    register(GTRXL)
