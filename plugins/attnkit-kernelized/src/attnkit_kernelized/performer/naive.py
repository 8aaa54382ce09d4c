"""The plain O(L·S) reference of ``performer`` (the spec's ``reference``).

The features as the paper writes them, with the module's random projection
(its ``features`` buffer) and scale, no stabiliser: ``A = phi(Q) phi(K)^T``
with the dense mask multiplied in, ``out = A V / A 1`` (0 where a query sees no
key). The stabilisers of the module are constants that cancel, so the two
agree to rounding wherever the unstabilised exponentials stay finite.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnkit.masks import Mask

from ..feature_maps import favor_generalized, favor_positive, favor_trig
from ..linear.naive import attention_from_features, dense_keep, zero_padded_keys


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """``performer`` computed the obvious way with ``attn``'s features, feature map and scale; ``(B, H, L, E)``."""
    keep = dense_keep(mask, q, k, positions)
    k, v = zero_padded_keys(mask, k, v)
    s = attn.get_scale(q) ** 0.5
    w = attn.features.to(q.dtype)
    phi = {"positive": favor_positive, "trig": favor_trig, "generalized": favor_generalized}[attn.feature_map]
    return attention_from_features(phi(q * s, w), phi(k * s, w), v, keep)   # the features of sqrt(scale)·q, ·k
