"""The call context: what ``forward`` resolved once, handed to an implementation's ``_attend``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .masks import Geometry, Mask
from .positions import Positions

__all__ = ["CallContext"]


@dataclass(eq=False)
class CallContext:
    """Everything :meth:`attnkit.Attention.forward` resolved, in one object.

    Attributes:
        mask: the one resolved :class:`~attnkit.masks.Mask` (``mask=``,
            ``causal``, ``key_padding_mask`` and ``attn_mask`` ``&``-ed), or None.
        geometry: ``B, H, L, S``, device and positions, for mask evaluation.
        backend: the backend to run (resolved once, cached per device, dtype
            and whether gradients are needed).
        scale: the multiplier of ``q·k`` (``1/sqrt(D)`` unless given).
        positions: :class:`~attnkit.positions.Positions` or None.
        state: the implementation's own state (``AttentionState.data``), or None.
        state_position: positions the state has consumed (0 without state).
        return_state: the caller wants ``(out, new_state)``; ``_attend`` then
            returns ``(out, new_data)``.
        needs_grad: autograd will need gradients of the output.
    """

    mask: Mask | None
    geometry: Geometry
    backend: str
    scale: float
    positions: Positions | None = None
    state: Any = None
    state_position: int = 0
    return_state: bool = False
    needs_grad: bool = False

    # -- convenience views of the mask, for implementations that honour a few kinds
    @property
    def causal(self) -> bool:
        """True when the mask includes the causal mask as an ``&``-ed part."""
        return self.mask is not None and self.mask.is_causal

    @property
    def key_padding_mask(self) -> Tensor | None:
        """bool ``(B, S)`` (True = real token) from the mask's key padding parts, or None."""
        return None if self.mask is None else self.mask.key_padding_mask

    def rest(self, *handled: str) -> Mask | None:
        """The mask without the ``&``-ed parts of the ``handled`` kinds (None when nothing remains)."""
        return None if self.mask is None else self.mask.without(*handled)

    def dense_keep(self, *, without: tuple[str, ...] = ()) -> Tensor | None:
        """bool ``(B', H', L, S)`` keep mask (materialised; for O(L·S) paths), or None when unmasked."""
        m = self.mask if not without else self.rest(*without)
        return None if m is None else m.dense(self.geometry)

    def bias(self, dtype: torch.dtype) -> Tensor | None:
        """The additive bias of tensor masks, broadcastable to ``(B, H, L, S)``, or None."""
        return None if self.mask is None else self.mask.bias(self.geometry, dtype)
