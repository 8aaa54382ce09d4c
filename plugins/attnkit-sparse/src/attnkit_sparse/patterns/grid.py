"""Patterns over a 2-D grid of positions (images): ``local-2d`` (2-D window) and ``axial`` (row and column).

Position ``p`` sits at row ``p // cols`` and column ``p % cols`` (raster
order). The grid is an option: ``(rows, cols)`` (then L = S = rows·cols,
anything else is refused), an int ``cols`` (rows follow from the length; a
last row may be partial), or None: ``cols = ceil(sqrt(n))`` with ``n`` the
number of positions (a square grid when n is a perfect square).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from attnkit import Limits
from attnkit.errors import InvalidInputError
from attnkit.masks import PARTIAL, Geometry, Mask, _states
from attnkit.masks import causal as causal_mask

from ..base import SparsePatternAttention, check_grid, check_int
from ._atoms import BIG, Atom, BlockBand, PeriodicBand, contiguous, position_extent, tile_ranges

__all__ = ["local_2d_mask", "axial_mask", "Local2DAttention", "AxialAttention", "grid_cols"]


def grid_cols(grid: Any, geom: Geometry) -> int:
    """Positions per row for ``grid`` (module docs) on this geometry."""
    if isinstance(grid, tuple):
        return grid[1]
    if isinstance(grid, int):
        return grid
    _, hi = position_extent(geom)
    return math.isqrt(max(hi, 0)) + 1


class _Rows(BlockBand):
    def __init__(self, grid: Any):
        super().__init__(None, 0, 0, name="axial-row")
        self.grid = grid

    def block_size(self, geom):
        return grid_cols(self.grid, geom)


class _Columns(PeriodicBand):
    def __init__(self, grid: Any):
        super().__init__(1, None, None, name="axial-column")
        self.grid = grid

    def _bounds(self, geom):
        return grid_cols(self.grid, geom), -BIG, BIG


class _Window2D(Atom):
    """Rows ``r - before_r ... r + after_r`` and columns ``c - before_c ... c + after_c`` (causal: ``& j <= i``)."""

    def __init__(self, grid: Any, window: tuple[int, int], causal: bool):
        super().__init__()
        self.grid, self.window, self.causal = grid, window, causal
        h, w = window
        self.rows = (h - 1, 0) if causal else (h // 2, (h - 1) // 2)
        self.cols = (w // 2, (w - 1) // 2)

    def _allow(self, h, qpos, kpos, geom):
        C = grid_cols(self.grid, geom)
        dr = torch.div(qpos, C, rounding_mode="floor") - torch.div(kpos, C, rounding_mode="floor")
        dc = qpos % C - kpos % C
        ok = (dr <= self.rows[0]) & (dr >= -self.rows[1]) & (dc <= self.cols[0]) & (dc >= -self.cols[1])
        return ok & (kpos <= qpos) if self.causal else ok

    def _blocks(self, geom, bq, bk):
        start = contiguous(geom)
        if start is None:
            return self._blocks_by_evaluation(geom, bq, bk)
        C = grid_cols(self.grid, geom)
        qlo, qhi, klo, khi = tile_ranges(geom, bq, bk, *start)
        dlo, dhi = qlo - khi, qhi - klo
        any_ = torch.zeros(dlo.shape, dtype=torch.bool, device=geom.device)
        for r in range(-self.rows[1], self.rows[0] + 1):  # d = r·C + (column offset): a superset of bands
            lo, hi = r * C - self.cols[1], r * C + self.cols[0]
            any_ |= (dhi >= lo) & (dlo <= hi)
        if self.causal:
            any_ &= dhi >= 0
        # tiles whose query block and key block each lie in one grid row: row offset and column ranges are
        # exact there; only tiles crossing a row boundary are evaluated element by element
        f = lambda x: torch.div(x, C, rounding_mode="floor")  # noqa: E731
        one_row = (f(qlo) == f(qhi)) & (f(klo) == f(khi))
        dr = f(qlo) - f(klo)
        dclo, dchi = qlo % C - khi % C, qhi % C - klo % C
        rows_ok = (dr <= self.rows[0]) & (dr >= -self.rows[1])
        exact_any = rows_ok & (dchi >= -self.cols[1]) & (dclo <= self.cols[0])
        exact_full = rows_ok & (dclo >= -self.cols[1]) & (dchi <= self.cols[0])
        if self.causal:
            exact_any &= dhi >= 0
            exact_full &= dlo >= 0
        state = torch.where(any_, PARTIAL, 0).to(torch.int8)
        state = torch.where(one_row, _states(exact_full, exact_any), state)[None, None].contiguous()
        return self._refine(geom, state, (state == PARTIAL) & ~one_row, bq, bk)

    def __repr__(self) -> str:
        return f"local_2d(grid={self.grid}, window={self.window}, causal={self.causal})"


def local_2d_mask(window: tuple[int, int], grid: Any = None, causal: bool = False) -> Mask:
    """The 2-D window of :class:`Local2DAttention`."""
    return _Window2D(check_grid("grid", grid), _check_window2d(window), causal)


def axial_mask(grid: Any = None, axis: str = "both", causal: bool = False) -> Mask:
    """Same row (``axis="row"``), same column (``"column"``) or either (``"both"``); causal: ``& causal()``."""
    grid = check_grid("grid", grid)
    if axis not in ("both", "row", "column"):
        raise InvalidInputError(f"axis: expected one of 'both', 'row', 'column', got {axis!r}")
    m: Mask = {"row": lambda: _Rows(grid), "column": lambda: _Columns(grid),
               "both": lambda: _Rows(grid) | _Columns(grid)}[axis]()
    return m & causal_mask() if causal else m


def _check_window2d(window: Any) -> tuple[int, int]:
    if isinstance(window, int) and not isinstance(window, bool):
        window = (window, window)
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise InvalidInputError(f"window: expected a pair (rows, cols) of ints >= 1 or one int >= 1, got {window!r}")
    return check_int("window[0] (rows)", window[0]), check_int("window[1] (cols)", window[1])


@dataclass(frozen=True)
class GridLimits(Limits):
    """Limits of a fixed ``(rows, cols)`` grid: L = S = rows·cols, said with the option's name."""

    grid: tuple[int, int] = (1, 1)

    def why_not(self, L: int, S: int) -> str | None:
        n = self.grid[0] * self.grid[1]
        if (L != n or S != n) and L and S:  # empty sequences are answered before any pattern
            return f"grid={self.grid} holds rows x cols = {n} positions: L and S must be {n}, got L={L}, S={S}"
        return None


class _GridAttention(SparsePatternAttention):
    @property
    def limits(self) -> Limits:
        if isinstance(self.grid, tuple):
            n = self.grid[0] * self.grid[1]
            return GridLimits(max_length=n, equal_length=True, length_multiple=n, grid=self.grid)
        return super().limits

    def _check_lengths(self, L: int, S: int) -> None:
        why = self.limits.why_not(L, S) if isinstance(self.grid, tuple) else None
        if why is not None:
            raise InvalidInputError(f"grid: {why}; pass grid=(rows, cols) with rows x cols = L, an int (positions "
                                    "per row) or None")


class Local2DAttention(_GridAttention):
    """2-D local attention (Image Transformer's 2-D local, as a per-query window): a ``window`` of grid cells.

    Query at row ``r``, column ``c`` sees the keys of rows
    ``r - window[0] // 2 ... r + (window[0] - 1) // 2`` and columns
    ``c - window[1] // 2 ... c + (window[1] - 1) // 2`` (no wrap-around to the
    next row): ``window[0] · window[1]`` keys, itself included, away from the
    image border. Causal (raster order): rows ``r - window[0] + 1 ... r``, the
    same columns, and only keys before it in its own row:
    ``(window[0] - 1) · window[1] + window[1] // 2 + 1`` keys. (The paper's
    query blocks with a memory flange extended up, left and right share this
    shape; attnkit centres the window on each query instead of on a block.)

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        window: (rows, cols) of the neighbourhood, or one int for both (ints >= 1). Default (5, 5).
        grid: (rows, cols) with rows x cols = L; an int (positions per row); or None
            (cols = ceil(sqrt(L)), a square grid for square L). Default None.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    def __init__(self, *, window: tuple[int, int] | int = (5, 5), grid: tuple[int, int] | int | None = None,
                 num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = _check_window2d(window)
        self.grid = check_grid("grid", grid)

    def _pattern(self, causal: bool) -> Mask:
        return local_2d_mask(self.window, self.grid, causal)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, grid={self.grid}"


class AxialAttention(_GridAttention):
    """Axial attention (Ho et al. 2019) in one head: a query sees its row and its column.

    ``axis="both"`` (default) is the union form: keys in the query's row or
    column, ``rows + cols - 1`` keys (itself once); one softmax over them.
    The paper applies row attention and column attention as separate layers:
    ``axis="row"`` / ``axis="column"`` give each (stack two modules for the
    factorised form). Causal (raster order): earlier keys of its row and the
    same column of earlier rows.

    Shapes as SDPA: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.

    Args:
        grid: (rows, cols) with rows x cols = L; an int (positions per row); or None
            (cols = ceil(sqrt(L)), a square grid for square L). Default None.
        axis: "both" (row or column, one softmax), "row" or "column". Default "both".
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU), "flex" (CUDA), "triton" (CUDA) or "torch".
    """

    option_constraints = {"axis": {"choices": ("both", "row", "column")}}

    def __init__(self, *, grid: tuple[int, int] | int | None = None, axis: str = "both",
                 num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.grid = check_grid("grid", grid)
        axial_mask(self.grid, axis)  # checks axis
        self.axis = axis

    def _pattern(self, causal: bool) -> Mask:
        return axial_mask(self.grid, self.axis, causal)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, grid={self.grid}, axis={self.axis!r}"
