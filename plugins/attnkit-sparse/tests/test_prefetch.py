"""The software prefetch of :mod:`attnkit.numba_prefetch` (tested here, in its first user: the core itself does not
depend on numba): it compiles for the arrays the kernels pass, changes nothing, and ignores rows out of range."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from attnkit.numba_prefetch import prefetch_row


@numba.njit
def _touch(A, rows):
    for r in rows:
        prefetch_row(A, r)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_prefetching_rows_changes_nothing_and_ignores_rows_out_of_range(dtype):
    A = np.arange(40 * 37, dtype=dtype).reshape(40, 37)      # rows not a whole number of lines
    before = A.copy()
    _touch(A, np.array([0, 39, 17, -1, 40, 10 ** 12], dtype=np.int64))
    np.testing.assert_array_equal(A, before)
    _touch(A[5:9, 3:20], np.array([0, 3, 4], dtype=np.int64))   # a view: strided rows, offset data pointer
    _touch(np.empty((3, 0), dtype=dtype), np.array([0, 1], dtype=np.int64))
    np.testing.assert_array_equal(A, before)
