"""``lsh`` (alias ``reformer``): Reformer's shared-QK LSH attention on the block-sparse engine."""

from .attention import LSHAttention

__all__ = ["LSHAttention"]
