"""The conformance kit on ``transformer-xl`` and ``compressive`` (each compression); the block suite on ``gtrxl``.

``reference`` holds the relative shift to the explicit-gather reference in
float64 (outputs and gradients); ``streaming`` holds both spellings
(``step`` and ``forward(state=..., return_state=True)``) to the plain
segment references, chunk by chunk.
"""

from __future__ import annotations

from attnkit_memory.compressive import naive as compressive_naive
from attnkit_memory.memory_tokens import naive as memory_tokens_naive
from attnkit_memory.transformer_xl import naive as txl_naive

from attnkit.testing import AttentionConformance, BlockConformance


class TestTransformerXLConformance(AttentionConformance):
    name = "transformer-xl"
    options = {"mem_len": 4}

    def streaming_reference(self, attn, q, k, v, chunk):
        return txl_naive.segment_reference(attn, q, k, v, chunk)


class TestTXLAliasLongMemoryConformance(AttentionConformance):
    name = "txl"
    options = {"mem_len": 16, "grad_segments": 2, "rel_dim": 6}

    def streaming_reference(self, attn, q, k, v, chunk):
        return txl_naive.segment_reference(attn, q, k, v, chunk)


class _Compressive(AttentionConformance):
    name = "compressive"

    def streaming_reference(self, attn, q, k, v, chunk):
        return compressive_naive.segment_reference(attn, q, k, v, chunk)


class TestCompressiveMeanConformance(_Compressive):
    options = {"mem_len": 3, "cmem_len": 2, "compression_rate": 2, "compression": "mean"}


class TestCompressiveMaxConformance(_Compressive):
    options = {"mem_len": 2, "cmem_len": 3, "compression_rate": 3, "compression": "max"}


class TestCompressiveConvConformance(_Compressive):
    options = {"mem_len": 3, "cmem_len": 2, "compression_rate": 2, "compression": "conv", "value_dim": 6}


class TestCompressiveMostUsedConformance(_Compressive):
    options = {"mem_len": 2, "cmem_len": 2, "compression_rate": 2, "compression": "most_used"}


class TestGTrXLBlockConformance(BlockConformance):
    name = "gtrxl"


class TestMemoryTokensConformance(AttentionConformance):
    name = "memory-tokens"
    options = {"num_memory": 3}

    def streaming_reference(self, attn, q, k, v, chunk):
        return memory_tokens_naive.segment_reference(attn, q, k, v, chunk)


class TestRMTAliasConformance(AttentionConformance):
    name = "rmt"
    options = {"num_memory": 2, "grad_segments": 2}

    def streaming_reference(self, attn, q, k, v, chunk):
        return memory_tokens_naive.segment_reference(attn, q, k, v, chunk)
