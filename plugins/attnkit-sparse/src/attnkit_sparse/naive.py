"""The plain reference of every pattern (each spec's ``reference``): dense masked softmax over the same mask.

``reference(attn, q, k, v, *, mask, positions)`` evaluates the module's own
pattern (``attn.pattern_mask``) ``&`` the caller's mask **element by
element** (``Mask.dense``: the mask function on every (query, key) pair,
never a block index) and runs the dense masked softmax
(:func:`attnkit_sparse.engine.reference_attend`). The conformance kit holds
every backend of every pattern to it in float64, outputs and gradients.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnkit.masks import Mask
from attnkit.positions import as_positions

__all__ = ["reference"]


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None, positions: Any = None) -> Tensor:
    """``softmax(scale·q kᵀ)`` over the pairs ``attn``'s pattern and ``mask`` both allow; rows with none are 0.

    Args:
        attn: the built module (its pattern and options).
        q, k, v: ``(B, H, L, D)``, ``(B, H, S, D)``, ``(B, H, S, E)``.
        mask: the resolved caller's mask (causal, padding, ...) or None.
        positions: what ``forward`` was given (None, an int offset, a tensor or Positions).

    Returns:
        ``(B, H, L, E)``. Materialises ``(B, H, L, S)``: tests only.
    """
    from .engine import reference_attend

    L, S = q.shape[2], k.shape[2]
    pat = attn.pattern_mask(L, S, causal=mask is not None and mask.is_causal)
    m = mask if pat is None else (pat if mask is None else pat & mask)
    return reference_attend(q, k, v, m, scale=attn.get_scale(q), positions=as_positions(positions, L=L, S=S))
