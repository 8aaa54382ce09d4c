"""Band patterns: ``local`` (sliding window), ``dilated`` (a window with gaps) and ``block-local``.

Masks (usable with any attention that executes mask objects)::

    local_mask(window, causal)            # window keys, itself included
    dilated_mask(window, dilation, causal)
    block_local_mask(block_size, causal, previous=False)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.errors import InvalidInputError
from attnkit.masks import Mask, sliding_window
from attnkit.masks import causal as causal_mask

from ..base import SparsePatternAttention, check_bool, check_int
from ._atoms import BlockBand, PeriodicBand

__all__ = ["local_mask", "dilated_mask", "block_local_mask", "LocalAttention", "DilatedAttention",
           "BlockLocalAttention", "split_window"]


def split_window(window: int, causal: bool) -> tuple[int, int]:
    """``(before, after)``: keys before and after the query that a window of ``window`` keys (itself included) holds.

    Causal: the ``window - 1`` previous keys and itself. Bidirectional:
    ``window // 2`` before and ``(window - 1) // 2`` after (centred; one more
    before than after when ``window`` is even).
    """
    if causal:
        return window - 1, 0
    return window // 2, (window - 1) // 2


def local_mask(window: int, causal: bool = False) -> Mask:
    """A query sees ``window`` keys, itself included: positions ``p - before ... p + after`` (:func:`split_window`)."""
    before, after = split_window(check_int("window", window), causal)
    return sliding_window(before, after)


def dilated_mask(window: int, dilation: int | tuple[int, ...], causal: bool = False) -> Mask:
    """A query at ``p`` sees ``window`` keys, itself included, ``dilation`` apart: ``p + m·dilation`` for
    ``m`` in ``-before ... after`` (:func:`split_window`); a tuple gives one dilation per head."""
    before, after = split_window(check_int("window", window), causal)
    return PeriodicBand(dilation, before, after, name="dilated")


def block_local_mask(block_size: int, causal: bool = False, previous: bool = False) -> Mask:
    """Positions ``p // block_size`` equal (and the previous block too with ``previous``); causal: ``& causal()``."""
    m = BlockBand(check_int("block_size", block_size), -1 if previous else 0, 0, name="block-local")
    return m & causal_mask() if causal else m


def _check_dilation(value: Any) -> int | tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if not value:
            raise InvalidInputError("dilation: expected an int >= 1 or one int >= 1 per head, got an empty list")
        return tuple(check_int(f"dilation[{i}]", d) for i, d in enumerate(value))
    return check_int("dilation", value)


class LocalAttention(SparsePatternAttention):
    """Local (sliding-window, band) attention: each query sees the ``window`` keys nearest to it.

    Keys per query, itself included: exactly ``window`` away from the
    sequence edges (fewer near them). Causal: the query and the
    ``window - 1`` keys before it. Bidirectional: ``window // 2`` keys before
    and ``(window - 1) // 2`` after (``window=5``: 2 + itself + 2;
    ``window=4``: 2 + itself + 1). O(L·window) time. The causal form streams
    exactly with a state of the last ``window - 1`` keys.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)``
    -> ``(B, H, L, E)``.

    Args:
        window: keys each query sees, itself included (an int >= 1): causal, itself and the
            window - 1 before; bidirectional, window // 2 before and (window - 1) // 2 after.
            Fewer near the sequence edges. Default 256.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"window": {"minimum": 1}}
    streams = True

    def __init__(self, *, window: int = 256, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = check_int("window", window)

    def _pattern(self, causal: bool) -> Mask:
        return local_mask(self.window, causal)

    def _still_visible(self, kpos: Tensor, next_pos: int) -> Tensor:
        return kpos > next_pos - self.window

    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, cp: Any) -> Tensor:
        """The causal window split along L (:func:`attnkit.context_parallel.context_parallel`).

        A halo exchange: each rank receives the ``window - 1`` keys and values just before its chunk
        (and their padding) from the ranks before it, and attends its queries to halo + chunk,
        bottom-right aligned, on the engine. Memory per rank: its chunk plus ``window - 1`` keys.
        """
        B, L = q.shape[0], q.shape[2]
        kpm = cp.key_padding_mask
        keep = torch.ones(B, L, dtype=torch.bool, device=q.device) if kpm is None else kpm
        hk, hv, hkeep = cp.halo([k, v, keep.to(k.dtype)[:, None, :, None]], self.window - 1)
        if hk.shape[2] == 0:
            return self(q, k, v, causal=True, key_padding_mask=kpm)
        keys, values = torch.cat([hk, k], dim=2), torch.cat([hv, v], dim=2)
        full = torch.cat([hkeep[:, 0, :, 0] > 0.5, keep], dim=1)
        return self(q, keys, values, causal=True, key_padding_mask=None if bool(full.all()) else full)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


class DilatedAttention(SparsePatternAttention):
    """Dilated sliding window: ``window`` keys, itself included, every ``dilation``-th position.

    Query at ``p`` sees ``p + m·dilation``: causal ``m = -(window - 1) ... 0``;
    bidirectional ``m = -(window // 2) ... (window - 1) // 2``. The window
    spans ``(window - 1)·dilation + 1`` positions. ``dilation`` may be one
    value per head (Longformer's multi-head dilation). The causal form
    streams exactly with a state of the last ``(window - 1)·dilation`` keys.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        window: keys each query sees, itself included (an int >= 1), dilation apart: causal,
            itself and window - 1 before; bidirectional, window // 2 before and (window - 1) // 2
            after. Default 256.
        dilation: gap between attended keys (an int >= 1, or one per head). Default 2.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"window": {"minimum": 1}}
    streams = True

    def __init__(self, *, window: int = 256, dilation: int | list[int] = 2, num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = check_int("window", window)
        self.dilation = _check_dilation(dilation)

    def _pattern(self, causal: bool) -> Mask:
        return dilated_mask(self.window, self.dilation, causal)

    def _still_visible(self, kpos: Tensor, next_pos: int) -> Tensor:
        d = max(self.dilation) if isinstance(self.dilation, tuple) else self.dilation
        return kpos >= next_pos - (self.window - 1) * d

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, dilation={self.dilation}"


class BlockLocalAttention(SparsePatternAttention):
    """Block-local attention: the sequence is cut into blocks of ``block_size`` positions; a query sees its block.

    Keys per query: ``block_size`` (bidirectional; ``2·block_size`` with
    ``previous``); causal: its block's positions up to itself
    (``p mod block_size + 1``, plus ``block_size`` with ``previous``).
    Blocks start at position 0.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        block_size: positions per block (an int >= 1). Default 64.
        previous: also attend to the previous block (Image Transformer's memory block). Default False.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"block_size": {"minimum": 1}}

    def __init__(self, *, block_size: int = 64, previous: bool = False, num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.block_size = check_int("block_size", block_size)
        self.previous = check_bool("previous", previous)

    def _pattern(self, causal: bool) -> Mask:
        return block_local_mask(self.block_size, causal, self.previous)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, previous={self.previous}"
