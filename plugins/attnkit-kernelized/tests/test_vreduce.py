"""The core's vector row reductions (:mod:`attnkit.numba_vreduce`, tested here: the core itself does not depend on
numba) against NumPy's ``nanmax`` / ``nanmin``, exactly: every length around the vector and unrolled widths of
either dtype, NaN and infinities anywhere (the first entry included), rows of NaN only, strided rows."""

from __future__ import annotations

import warnings

import numba
import numpy as np
import pytest

from attnkit.numba_vreduce import column_max_min, first_index, row_max, row_min


@numba.njit(cache=True)
def _each(X, which):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], X.dtype)
    for i in range(X.shape[0]):
        out[i] = row_max(X[i]) if which == 0 else row_min(X[i])
    return out


@numba.njit(cache=True)
def _columns(X, which):  # pragma: no cover - compiled
    out = np.empty(X.shape[1], X.dtype)
    for j in range(X.shape[1]):
        out[j] = row_max(X[:, j]) if which == 0 else row_min(X[:, j])
    return out


def _ref(X: np.ndarray, which: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)      # all-NaN rows: NaN, as expected
        return np.nanmax(X, axis=-1) if which == 0 else np.nanmin(X, axis=-1)


LENGTHS = [*range(1, 70), 127, 128, 129, 255, 256, 257]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("which", [0, 1])
def test_rows_match_numpy_at_every_length(dt: type, which: int) -> None:
    rng = np.random.default_rng(3 + which)
    for n in LENGTHS:
        X = rng.standard_normal((5, n)).astype(dt)
        X[1, n // 2] = 50.0 if which == 0 else -50.0          # the extreme in the middle,
        X[2, -1] = 60.0 if which == 0 else -60.0              # in the scalar tail,
        X[3, 0] = 70.0 if which == 0 else -70.0               # and first
        np.testing.assert_array_equal(_each(X, which), _ref(X, which), err_msg=f"n={n}")


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("which", [0, 1])
def test_nan_is_ignored_and_infinities_count(dt: type, which: int) -> None:
    rng = np.random.default_rng(11)
    for n in (1, 7, 33, 100, 256):
        X = rng.standard_normal((6, n)).astype(dt)
        X[0, 0] = np.nan                                      # NaN first: the result is the rest's extreme
        X[1, rng.integers(0, n)] = np.nan
        X[2, :] = np.nan                                      # NaN only: NaN
        X[3, rng.integers(0, n)] = np.inf
        X[4, rng.integers(0, n)] = -np.inf
        X[5, ::2] = np.nan
        got, ref = _each(X, which), _ref(X, which)
        np.testing.assert_array_equal(got, ref, err_msg=f"n={n}")
        assert np.isnan(got[2])
        if n > 1:
            assert not np.isnan(got[0]) and not np.isnan(got[1]) and not np.isnan(got[5])


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("which", [0, 1])
def test_strided_rows(dt: type, which: int) -> None:
    X = np.random.default_rng(5).standard_normal((67, 9)).astype(dt)
    X[13, 2] = np.nan
    np.testing.assert_array_equal(_columns(X, which), _ref(X.T, which))
    Y = np.ascontiguousarray(X.T)[:, ::3]                    # every third entry of each row
    np.testing.assert_array_equal(_each(Y, which), _ref(Y, which))


@numba.njit(cache=True)
def _first(X, values):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], np.int64)
    for i in range(X.shape[0]):
        out[i] = first_index(X[i], values[i])
    return out


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_first_index_is_the_first_match_or_minus_one(dt: type) -> None:
    rng = np.random.default_rng(17)
    for n in LENGTHS:
        X = rng.integers(-3, 4, size=(4, n)).astype(dt)       # repeated values: the first one counts
        X[1, rng.integers(0, n)] = np.nan
        values = np.array([X[0, rng.integers(0, n)], X[1, -1], 99.0, np.nan], dtype=dt)
        got = _first(X, values)
        for i in range(4):
            hits = np.flatnonzero(X[i] == values[i])
            assert got[i] == (hits[0] if hits.size else -1), (n, i)
        assert got[2] == -1 and got[3] == -1                  # absent; NaN equals nothing
    Y = np.ascontiguousarray(X.T)[:, ::2]                     # strided rows take the loop
    hits = [np.flatnonzero(Y[i] == Y[i, -1])[0] for i in range(Y.shape[0])]
    np.testing.assert_array_equal(_first(Y, Y[:, -1].copy()), hits)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_first_maximum_is_nanargmax(dt: type) -> None:
    rng = np.random.default_rng(23)
    for n in LENGTHS:
        X = rng.integers(-5, 6, size=(3, n)).astype(dt)
        X[2, 0] = np.nan
        for i in range(3):
            if not np.isnan(X[i]).all():
                assert _first(X[i:i + 1], np.array([_each(X[i:i + 1], 0)[0]], dtype=dt))[0] == np.nanargmax(X[i])


@numba.njit(cache=True)
def _columns_all(X, n):  # pragma: no cover - compiled
    C = X.shape[1]
    mx, mn = np.full(C + 3, 7.0, X.dtype), np.full(C + 3, 7.0, X.dtype)
    ix, jx = np.full(C + 3, 7, np.int64), np.full(C + 3, 7, np.int64)
    column_max_min(X, n, mx, ix, mn, jx)
    return mx, ix, mn, jx


def _column_ref(X: np.ndarray) -> tuple[np.ndarray, ...]:
    """NumPy's answer: the extremes down each column (NaN ignored) and their first rows; NaN and -1 for a column
    of NaN only."""
    out = []
    for which in (0, 1):
        v = _ref(X.T, which)
        first = [np.flatnonzero(X[:, e] == v[e])[0] if not np.isnan(v[e]) else -1 for e in range(X.shape[1])]
        out += [v, np.array(first, dtype=np.int64)]
    return tuple(out)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_column_max_min_matches_numpy(dt: type) -> None:
    """Down every column of a block (a vector lane per column, the last ``C % W`` columns by a loop): the largest
    and smallest entries and the first rows holding them, ties to the first row, NaN ignored, columns of
    infinities and NaN only; outputs past the block's columns keep their values."""
    rng = np.random.default_rng(31)
    for n, C in [(1, 1), (5, 16), (128, 16), (7, 8), (33, 40), (3, 17), (64, 32), (2, 9)]:
        X = rng.integers(-4, 5, size=(n + 2, C)).astype(dt)         # repeated values: the first row counts
        X[n:] = 99.0                                                 # rows past n are not read
        X[rng.integers(0, n), 0] = np.nan
        if C > 3:
            X[:n, 1] = np.nan                                        # NaN only: NaN and -1
            X[:n, 2] = -np.inf                                       # -inf only: -inf at row 0 (max and min)
            X[:n, 3] = np.inf
            X[0, 3] = np.nan                                         # NaN, then +inf
        got = _columns_all(X, n)
        ref = _column_ref(X[:n])
        for g, r, name in zip(got, ref, ("max", "first max", "min", "first min")):
            np.testing.assert_array_equal(g[:C], r, err_msg=f"{name}, n={n}, C={C}")
            assert (g[C:] == 7).all(), name
    Y = rng.standard_normal((20, 48)).astype(dt)[:, ::3]            # strided rows: the loop, same answers
    for g, r in zip(_columns_all(Y, 20), _column_ref(Y)):
        np.testing.assert_array_equal(g[:16], r)
