"""The core's own implementations, registered through the same hook as any plugin."""

from __future__ import annotations

from ._version import API_VERSION
from .hookspecs import hookimpl
from .spec import AttentionSpec, Capabilities, Paper

ATTNKIT_API_VERSION = API_VERSION

SOFTMAX = AttentionSpec(
    name="softmax",
    aliases=("exact",),
    factory="attnkit.softmax:SoftmaxAttention",
    family="core",
    summary="Exact scaled dot-product attention (SDPA fast path, naive reference).",
    paper=Paper("Vaswani et al.", 2017, "Attention Is All You Need", "1706.03762"),
    exact=True,
    reference="attnkit.reference:softmax_reference",
    capabilities=Capabilities(
        func_transforms=("grad", "vmap", "jvp"), export=True, export_backends=("sdpa", "torch"),
        export_dynamic=("sdpa", "torch"),
        causal=True,
        key_padding_mask=True,
        attn_mask=True,
        cross=True,
        causal_cross=True,
        streaming="exact",
        dtypes=("float16", "bfloat16", "float32", "float64"),
        positions=True,
        backends=("sdpa", "torch"),
        time="O(L·S·D)",
        memory="O(L·S) torch path; O(L) with flash SDPA",
    ),
)


@hookimpl
def attnkit_register_attention(register):
    """Register exact softmax attention."""
    register(SOFTMAX)


@hookimpl
def attnkit_register_block(register):
    """Register the standard pre-norm block (``x + attn(norm(x))``, ``x + mlp(norm(x))``)."""
    from .spec import BlockSpec

    register(BlockSpec(
        name="pre-norm",
        aliases=("transformer",),
        factory="attnkit.layers:TransformerBlock",
        family="core",
        summary="Pre-norm Transformer block: x + attn(norm(x)), then x + mlp(norm(x)).",
        paper=Paper("Xiong et al.", 2020, "On Layer Normalization in the Transformer Architecture", "2002.04745"),
    ))
