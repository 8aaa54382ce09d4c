"""``sinkhorn``: Sparse Sinkhorn attention (learned block sorting) on the block-sparse engine."""

from .attention import SinkhornAttention

__all__ = ["SinkhornAttention"]
