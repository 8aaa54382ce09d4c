"""Global tokens on top of a window: ``global`` (window + global tokens) and ``longformer``.

Global tokens are positions: a query at a global position sees every key, and
a key at a global position is seen by every query (causal forms: every
*earlier* key / every *later* query).
"""

from __future__ import annotations

from typing import Any

from attnkit import Limits, shortest_lengths, transforms
from attnkit.errors import InvalidInputError
from attnkit.masks import Mask
from attnkit.masks import causal as causal_mask

from ..base import SparsePatternAttention, check_int, check_positions
from ._atoms import PeriodicBand, PositionSet
from .local import _check_dilation, local_mask

__all__ = ["global_mask", "longformer_mask", "GlobalAttention", "LongformerAttention"]


def _with_globals(band: Mask, positions: tuple[int, ...], causal: bool) -> Mask:
    """``band | global keys | global queries``; causal: ``band`` is already causal, the global parts get
    ``& causal()`` each (so only their own diagonal tiles are refined, not every window tile)."""
    keys, queries = PositionSet(positions, "key"), PositionSet(positions, "query")
    if causal:
        return band | (keys & causal_mask()) | (queries & causal_mask())
    return band | keys | queries


def global_mask(window: int, global_positions: tuple[int, ...], causal: bool = False) -> Mask:
    """``local_mask(window, causal)`` plus global tokens at ``global_positions`` (see the module docs)."""
    return _with_globals(local_mask(window, causal), check_positions("global_positions", global_positions), causal)


def longformer_mask(window: int, global_positions: tuple[int, ...], causal: bool = False,
                    dilation: int | tuple[int, ...] = 1) -> Mask:
    """Longformer: ``window // 2`` keys ``dilation`` apart on each side and itself (causal: the ``window``
    previous and itself), plus global tokens at ``global_positions``."""
    window = check_int("window", window)
    band = PeriodicBand(_check_dilation(dilation), window if causal else window // 2, 0 if causal else window // 2,
                        name="longformer-window")
    return _with_globals(band, check_positions("global_positions", global_positions), causal)


class _GlobalTokens(SparsePatternAttention):
    """Shared option handling of ``num_global`` / ``global_positions``."""

    def _init_globals(self, num_global: Any, global_positions: Any) -> None:
        if global_positions is not None:
            if num_global is not None:
                raise InvalidInputError(
                    f"num_global / global_positions: give one of them, got num_global={num_global!r} and "
                    f"global_positions={global_positions!r}")
            self.global_positions = check_positions("global_positions", global_positions)
            self.num_global = len(self.global_positions)
            self._explicit = True
        else:
            self.num_global = check_int("num_global", 1 if num_global is None else num_global)
            self.global_positions = tuple(range(self.num_global))
            self._explicit = False

    @property
    def limits(self) -> Limits:
        """The base's limits; with explicit ``global_positions``, keys reaching past the last of them (a shorter
        sequence is refused as a limit: :class:`attnkit.ShortestLengths`)."""
        base = super().limits
        if not self._explicit:
            return base
        last = self.global_positions[-1]
        return shortest_lengths(base, min_keys=last + 1, reason=(
            f"global_positions: the global position {last} needs at least {last + 1} keys (build it with "
            "positions inside the sequence)"))

    def _check_lengths(self, L: int, S: int) -> None:
        if transforms.symbolic(L, S):
            # a dynamic-length program: asserted when it runs (a comparison would fix the length's range)
            if self._explicit:
                transforms.assert_at_least(S, self.global_positions[-1] + 1, "global_positions: the keys")
            return
        n = max(L, S)
        if self._explicit and n and self.global_positions[-1] >= n:
            bad = [p for p in self.global_positions if p >= n]
            raise InvalidInputError(
                f"global_positions: expected positions in [0, {n}) for a sequence of {n} positions "
                f"(L={L}, S={S}), got {bad} out of range")

    def extra_repr(self) -> str:
        g = f"global_positions={self.global_positions}" if self._explicit else f"num_global={self.num_global}"
        return f"{super().extra_repr()}, window={self.window}, {g}"


class GlobalAttention(_GlobalTokens):
    """Local window plus global tokens (Star-Transformer's relay node, ETC / Longformer's global tokens).

    A query at a global position sees every key; every query sees the keys at
    global positions; the others see their ``window`` (as ``local``: itself
    included; causal: itself and the ``window - 1`` before; bidirectional:
    ``window // 2`` before, ``(window - 1) // 2`` after). Keys per query:
    ``window`` plus the global keys outside its window (every key, S, for a
    global query; causal: the earlier ones).

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        window: keys of the local window, itself included (an int >= 1). Default 256.
        num_global: global tokens at positions 0 ... num_global - 1; None means 1
            (the first token) unless global_positions is given.
        global_positions: explicit global positions (distinct ints >= 0, each below the
            sequence length); give this or num_global.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"window": {"minimum": 1}, "num_global": {"minimum": 1}}

    def __init__(self, *, window: int = 256, num_global: int | None = None,
                 global_positions: list[int] | None = None, num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = check_int("window", window)
        self._init_globals(num_global, global_positions)

    def _pattern(self, causal: bool) -> Mask:
        return global_mask(self.window, self.global_positions, causal)


class LongformerAttention(_GlobalTokens):
    """Longformer (Beltagy et al. 2020): a (dilated) sliding window plus task-specific global tokens.

    With the paper's window ``w`` (even), a query sees ``w / 2`` keys on each
    side and itself: ``w + 1`` keys (positions ``p + m·dilation``,
    ``|m| <= w / 2``); causal (the paper's autoregressive form): the ``w``
    previous keys and itself. Global tokens see every key and are seen by
    every query (causal: earlier keys / later queries). Default: the paper's
    ``w = 512`` and one global token, the first ([CLS]).

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        window: the paper's w: w // 2 keys on each side (causal: w previous keys), itself
            included on top (an int >= 1). Default 512.
        dilation: gap between window keys (an int >= 1, or one per head). Default 1.
        num_global: global tokens at positions 0 ... num_global - 1; None means 1
            (the first token) unless global_positions is given.
        global_positions: explicit global positions (distinct ints >= 0, each below the
            sequence length); give this or num_global.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"window": {"minimum": 1}, "num_global": {"minimum": 1}}

    def __init__(self, *, window: int = 512, dilation: int | list[int] = 1, num_global: int | None = None,
                 global_positions: list[int] | None = None, num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = check_int("window", window)
        self.dilation = _check_dilation(dilation)
        self._init_globals(num_global, global_positions)

    def _pattern(self, causal: bool) -> Mask:
        return longformer_mask(self.window, self.global_positions, causal, self.dilation)
