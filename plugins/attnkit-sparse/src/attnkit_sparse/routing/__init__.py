"""``routing``: Routing Transformer attention (online k-means clusters) on the block-sparse engine."""

from .attention import RoutingAttention

__all__ = ["RoutingAttention"]
