"""The register panels of :mod:`attnkit.numba_panel` (tested here: the core itself does not depend on numba)
against float64 numpy products (added to the output, or written over it: ``set_rows``): every row and column
remainder, offsets into the operands, strided coefficients, non-unit output strides (the plain-loop fallback),
empty sums; its register-tile transpose against numpy's, exactly; the aligned tile buffers; the engine's row
``exp``."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from attnkit.numba_panel import (
    ALIGN,
    _panels_256,
    _panels_512,
    axpy_at,
    axpy_rows,
    axpy_t,
    empty_aligned,
    set_at,
    set_rows,
    set_t,
    transpose,
    zeros_aligned,
)
from attnkit_sparse.engine._numba_kernels import _exp_sub


@numba.njit(cache=True)
def _at(OUT, on, C, c0, Y, y0, yn):  # pragma: no cover - compiled
    axpy_at(OUT, on, C, c0, Y, y0, yn)


@numba.njit(cache=True)
def _t(OUT, o0, n, CT, Y, y0, j0, j1):  # pragma: no cover - compiled
    axpy_t(OUT, o0, n, CT, Y, y0, j0, j1)


# (rows, terms, columns): rows around the 4-row panel, columns around one and two vectors of either dtype
# (axpy_t, one vector of columns: the 16-row panels, then 4-row and single rows: (37, 9, 16), (50, 7, 24), (33, 5, 8))
SHAPES = [(0, 5, 8), (1, 1, 1), (3, 7, 5), (4, 16, 16), (5, 9, 24), (7, 13, 37), (13, 64, 64), (9, 3, 40),
          (6, 0, 16), (4, 2, 0), (37, 9, 16), (50, 7, 24), (33, 5, 8)]
DTYPES = [np.float32, np.float64]


def _tol(dt: type) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dt == np.float32 else {"rtol": 1e-12, "atol": 1e-12}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_axpy_at_matches_numpy(dt: type, shape: tuple[int, int, int]) -> None:
    on, K, E = shape
    rng = np.random.default_rng(on * 100 + K * 10 + E)
    C = rng.standard_normal((on + 2, K + 5)).astype(dt)
    Y = rng.standard_normal((K + 6, E)).astype(dt)
    OUT = rng.standard_normal((on + 1, E)).astype(dt)       # one row past `on`: must stay as it is
    ref = OUT.astype(np.float64)
    c0, y0 = 2, 3
    ref[:on] += C[:on, c0:c0 + K].astype(np.float64) @ Y[y0:y0 + K].astype(np.float64)
    _at(OUT, on, C, c0, Y, y0, K)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_axpy_t_matches_numpy(dt: type, shape: tuple[int, int, int]) -> None:
    n, K, E = shape
    rng = np.random.default_rng(7 + n * 100 + K * 10 + E)
    CT = rng.standard_normal((K + 6, n + 4)).astype(dt)     # key-major coefficients
    Y = rng.standard_normal((K + 9, E)).astype(dt)
    OUT = rng.standard_normal((n + 3, E)).astype(dt)        # rows before o0 and after o0 + n: untouched
    ref = OUT.astype(np.float64)
    o0, y0, j0 = 1, 3, 2
    ref[o0:o0 + n] += CT[j0:j0 + K, o0:o0 + n].T.astype(np.float64) @ Y[y0 + j0:y0 + j0 + K].astype(np.float64)
    _t(OUT, o0, n, CT, Y, y0, j0, j0 + K)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))


@pytest.mark.parametrize("dt", DTYPES)
def test_tall_panel_sums_as_the_short_ones(dt: type) -> None:
    """A single vector of columns with adjacent coefficients (``axpy_t``) runs 16 rows a panel; each output is the
    same chain of fused multiply-adds as in the 4-row panels that ``axpy_at`` runs on the same product, so the two
    agree bit for bit (``lsh``'s hash compares its rotations exactly)."""
    rng = np.random.default_rng(29)
    W = 16 if dt == np.float32 else 8
    n, K = 45, 64
    CT = rng.standard_normal((K, n)).astype(dt)
    C = np.ascontiguousarray(CT.T)
    Y = rng.standard_normal((K, W)).astype(dt)
    tall, short = np.zeros((n, W), dt), np.zeros((n, W), dt)
    _t(tall, 0, n, CT, Y, 0, 0, K)
    _at(short, n, C, 0, Y, 0, K)
    np.testing.assert_array_equal(tall, short)
    np.testing.assert_allclose(tall, C.astype(np.float64) @ Y.astype(np.float64), **_tol(dt))


@numba.njit(cache=True)
def _rows(OUT, C, Y, on, yn, ne):  # pragma: no cover - compiled
    axpy_rows(OUT, C, Y, on, yn, ne)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_axpy_rows_matches_numpy(dt: type, shape: tuple[int, int, int]) -> None:
    """The kernelized plugin's form: ``ne`` columns of wider operands, row-sliced views; columns past ``ne`` and
    rows past ``on`` keep their values."""
    on, K, ne = shape
    rng = np.random.default_rng(11 + on * 100 + K * 10 + ne)
    C = rng.standard_normal((on + 3, K + 2)).astype(dt)
    Y = rng.standard_normal((K + 1, ne + 5)).astype(dt)
    OUT = rng.standard_normal((on + 4, ne + 3)).astype(dt)
    ref = OUT.astype(np.float64)
    ref[1:1 + on, :ne] += C[2:2 + on, :K].astype(np.float64) @ Y[:K, :ne].astype(np.float64)
    _rows(OUT[1:], C[2:], Y, on, K, ne)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))


@numba.njit(cache=True)
def _set(OUT, C, Y, on, yn, ne):  # pragma: no cover - compiled
    set_rows(OUT, C, Y, on, yn, ne)


@pytest.mark.parametrize("strided", [False, True], ids=["rows", "strided"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_set_rows_overwrites(dt: type, shape: tuple[int, int, int], strided: bool) -> None:
    """:func:`set_rows` writes the product over whatever the output block held (NaN here, in the panels' columns
    and the plain loop's, and with no terms at all: zeros), through the panels or, for an output whose rows are
    strided, the plain loop; columns past ``ne`` and rows past ``on`` keep their values."""
    on, K, ne = shape
    rng = np.random.default_rng(13 + on * 100 + K * 10 + ne)
    C = rng.standard_normal((on + 3, K + 2)).astype(dt)
    Y = rng.standard_normal((K + 1, ne + 5)).astype(dt)
    OUT = rng.standard_normal((on + 4, 2 * (ne + 3))).astype(dt)
    OUT[1:1 + on, :2 * ne] = np.nan
    ref = OUT.astype(np.float64)
    view = OUT[1:, ::2] if strided else OUT[1:]
    (ref[1:, ::2] if strided else ref[1:])[:on, :ne] = C[2:2 + on, :K].astype(np.float64) @ Y[:K, :ne].astype(
        np.float64)
    _set(view, C[2:], Y, on, K, ne)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))


@numba.njit(cache=True)
def _set_at(OUT, on, C, c0, Y, y0, yn):  # pragma: no cover - compiled
    set_at(OUT, on, C, c0, Y, y0, yn)


@numba.njit(cache=True)
def _set_t(OUT, o0, n, CT, Y, y0, j0, j1):  # pragma: no cover - compiled
    set_t(OUT, o0, n, CT, Y, y0, j0, j1)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_set_at_and_set_t_overwrite(dt: type, shape: tuple[int, int, int]) -> None:
    """:func:`set_at` and :func:`set_t` (coefficients key-major: the 16-row panels for one vector of columns)
    write over NaN; no terms write zeros; rows outside the block keep their values."""
    on, K, E = shape
    rng = np.random.default_rng(17 + on * 100 + K * 10 + E)
    C = rng.standard_normal((on + 2, K + 5)).astype(dt)
    Y = rng.standard_normal((K + 6, E)).astype(dt)
    OUT = rng.standard_normal((on + 1, E)).astype(dt)
    OUT[:on] = np.nan
    ref = OUT.astype(np.float64)
    ref[:on] = C[:on, 2:2 + K].astype(np.float64) @ Y[3:3 + K].astype(np.float64)
    _set_at(OUT, on, C, 2, Y, 3, K)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))
    CT = rng.standard_normal((K + 3, on + 4)).astype(dt)
    OUT = rng.standard_normal((on + 3, E)).astype(dt)
    OUT[2:2 + on] = np.nan
    ref = OUT.astype(np.float64)
    ref[2:2 + on] = CT[1:1 + K, 2:2 + on].T.astype(np.float64) @ Y[1 + 1:1 + 1 + K].astype(np.float64)
    _set_t(OUT, 2, on, CT, Y, 1, 1, 1 + K)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))


@pytest.mark.parametrize("dt", DTYPES)
def test_strided_operands(dt: type) -> None:
    """Coefficients read through a transposed view; an output and terms whose rows are not contiguous take the
    plain loop and give the same values."""
    rng = np.random.default_rng(3)
    C = np.asfortranarray(rng.standard_normal((11, 19)).astype(dt))
    Y = rng.standard_normal((19, 2 * 37)).astype(dt)[:, ::2]     # column stride 2
    OUT = np.zeros((11, 2 * 37), dtype=dt)[:, ::2]
    ref = C.astype(np.float64) @ Y.astype(np.float64)
    _at(OUT, 11, C, 0, Y, 0, 19)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))
    Yc = np.ascontiguousarray(Y)
    OUT2 = np.zeros((11, 37), dtype=dt)
    _at(OUT2, 11, C, 0, Yc, 0, 19)
    np.testing.assert_allclose(OUT2, ref, **_tol(dt))


@numba.njit(cache=True)
def _transpose(OUT, X, nr, nc):  # pragma: no cover - compiled
    transpose(OUT, X, nr, nc)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (1, 1), (3, 3), (4, 4), (8, 8), (13, 37), (32, 256), (17, 64)])
def test_transpose_matches_numpy(dt: type, shape: tuple[int, int]) -> None:
    """Whole tiles of either dtype and every edge: ``OUT[:nc, :nr] = X[:nr, :nc].T`` bit for bit (a move, no
    arithmetic), NaN and inf carried as they are; rows and columns of ``OUT`` beyond them keep their values."""
    nr, nc = shape
    rng = np.random.default_rng(nr * 100 + nc)
    X = rng.standard_normal((nr + 2, nc + 3)).astype(dt)
    X.flat[::7] = np.nan
    X.flat[3::11] = np.inf
    OUT = rng.standard_normal((nc + 1, nr + 4)).astype(dt)
    ref = OUT.copy()
    ref[:nc, :nr] = X[:nr, :nc].T
    _transpose(OUT, X, nr, nc)
    np.testing.assert_array_equal(OUT, ref)


@pytest.mark.parametrize("dt", DTYPES)
def test_transpose_views(dt: type) -> None:
    """Row-reversed and row-sliced views (negative and long row strides: the tiles), and a column-strided source
    (the plain loop)."""
    rng = np.random.default_rng(5)
    Y = rng.standard_normal((40, 24)).astype(dt)
    OUT = np.zeros((24, 32), dtype=dt)
    _transpose(OUT, Y[3:35][::-1], 32, 24)                       # reversed rows: negative stride
    np.testing.assert_array_equal(OUT, Y[3:35][::-1].T)
    OUT2 = np.zeros((12, 40), dtype=dt)
    _transpose(OUT2, Y[:, ::2], 40, 12)                          # column stride 2: the plain loop
    np.testing.assert_array_equal(OUT2, Y[:, ::2].T)


@numba.njit(cache=True)
def _both_widths(OUT, C, Y, on, yn, ne, wide, keep=1):  # pragma: no cover - compiled
    it = OUT.itemsize
    if wide:
        _panels_512(OUT, 0, OUT.strides[0] // it, on, C, 0, C.strides[0] // it, C.strides[1] // it, Y, 0,
                    Y.strides[0] // it, yn, ne, keep)
    else:
        _panels_256(OUT, 0, OUT.strides[0] // it, on, C, 0, C.strides[0] // it, C.strides[1] // it, Y, 0,
                    Y.strides[0] // it, yn, ne, keep)


@pytest.mark.parametrize("keep", [1, 0], ids=["add", "set"])
@pytest.mark.parametrize("wide", [False, True], ids=["256-bit", "512-bit"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(4, 5, 64), (5, 9, 120), (7, 3, 56), (9, 17, 72), (3, 4, 200), (8, 6, 16),
                                   (1, 2, 8), (6, 5, 4), (17, 3, 16)])
def test_panel_widths_cover_their_columns(keep: int, wide: bool, dt: type, shape: tuple[int, int, int]) -> None:
    """Either width (:data:`attnkit.numba_panel.PANEL_BITS` picks one by the CPU; both run on any x86-64 CPU,
    a 512-bit one as two halves without AVX-512): each column below ``E - E % h`` (``h`` the lanes of a 256-bit
    vector) gets its sum, through every block of 4, 2, 1 wide vectors (and the 16-row panel) and the half-width
    tail, full 4-row panels and the remaining rows, added to the output (``keep`` 1) or written over it
    (``keep`` 0: NaN there before must not survive); the tail columns and the rows past ``on`` are left
    untouched."""
    on, K, E = shape
    h = 8 if dt == np.float32 else 4
    cover = E - E % h
    rng = np.random.default_rng(on * 1000 + K * 10 + E + wide)
    C = np.asfortranarray(rng.standard_normal((on + 2, K)).astype(dt))   # column-major: the 16-row panel's terms
    Y = rng.standard_normal((K, E)).astype(dt)
    OUT = rng.standard_normal((on + 2, E)).astype(dt)
    if not keep:
        OUT[:on, :cover] = np.nan
    ref = OUT.astype(np.float64)
    prod = C[:on].astype(np.float64) @ Y[:, :cover].astype(np.float64)
    if keep:
        ref[:on, :cover] += prod
    else:
        ref[:on, :cover] = prod
    _both_widths(OUT, C, Y, on, K, E, wide, keep)
    np.testing.assert_allclose(OUT, ref, **_tol(dt))


def test_panel_bits_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ATTNKIT_PANEL_BITS`` overrides the CPU's choice; a value other than 256 or 512 is refused by name."""
    from attnkit import numba_panel

    monkeypatch.setenv("ATTNKIT_PANEL_BITS", "256")
    assert numba_panel._panel_bits() == 256
    monkeypatch.setenv("ATTNKIT_PANEL_BITS", "512")
    assert numba_panel._panel_bits() == 512
    monkeypatch.setenv("ATTNKIT_PANEL_BITS", "1024")
    with pytest.raises(ValueError, match="ATTNKIT_PANEL_BITS: expected 256 or 512, got '1024'"):
        numba_panel._panel_bits()
    monkeypatch.delenv("ATTNKIT_PANEL_BITS")
    assert numba_panel._panel_bits() == (512 if numba_panel._target_has_avx512() else 256)
    monkeypatch.setattr(numba.core.config, "CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert not numba_panel._target_has_avx512()
    monkeypatch.setattr(numba.core.config, "CPU_FEATURES", "+avx2,+avx512f")
    assert numba_panel._target_has_avx512()


@numba.njit(cache=True)
def _exp_sub_rows(X, scl, sub):  # pragma: no cover - compiled
    for i in range(X.shape[0]):
        _exp_sub(X[i], scl, sub)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 33, 64, 100])
def test_exp_sub_matches_numpy(dt: type, n: int) -> None:
    """The engine's in-place ``exp(scl·x − sub)`` (:func:`attnkit_sparse.engine._numba_kernels._exp_sub`): whole
    vectors through the core's vector exp (:func:`attnkit.numba_vexp.exp_sub_at`), the rest one element at a time
    (:func:`attnkit.numba_vexp.exp_sub_item`), so every length and both halves agree with NumPy; masked scores
    (-inf) give 0, NaN stays NaN, arguments below the underflow bound give 0. A strided row (every element on the
    one-element path) gives the same bits as a contiguous one: the two paths are one arithmetic."""
    rng = np.random.default_rng(n)
    X = (rng.standard_normal((3, n)) * 4).astype(dt)
    X[0, :: 3] = -np.inf
    X[1, n // 2] = np.nan
    X[2, 0] = -1e4
    sub = rng.standard_normal(n + 5).astype(dt)
    scl = dt(0.7)
    ref = np.exp(X.astype(np.float64) * float(scl) - sub[:n].astype(np.float64))
    strided = np.array(X, order="F")       # a copy whose rows have a stride of 3 elements
    _exp_sub_rows(X, scl, sub)
    _exp_sub_rows(strided, scl, sub)
    # float32: the argument scl*x - sub is rounded before the exp (up to ~3.5e-7 relative at |arg| ~ 5)
    np.testing.assert_allclose(X, ref, rtol=1e-6 if dt == np.float32 else 1e-13, atol=0)
    assert np.isnan(X[1, n // 2]) and X[2, 0] == 0 and (X[0, ::3] == 0).all()
    np.testing.assert_array_equal(strided, X)


@numba.njit(cache=True)
def _aligned_many(rows, cols, like, zero):  # pragma: no cover - compiled
    """Twenty buffers of each kind, filled through their last element: each one's address modulo ALIGN, and
    whether each zeros_aligned one held zeros only."""
    mods = np.empty(40, dtype=np.int64)
    zeros_ok = True
    keep = []
    for i in range(20):
        a = empty_aligned(rows, cols, like)
        b = zeros_aligned(rows, cols, like)
        zeros_ok = zeros_ok and (b == zero).all()
        a[:] = i
        b[rows - 1, cols - 1] = i
        mods[2 * i] = a.ctypes.data % ALIGN
        mods[2 * i + 1] = b.ctypes.data % ALIGN
        keep.append(a)
    return mods, zeros_ok, keep[-1]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (32, 64), (64, 33)])
def test_aligned_buffers_start_on_a_cache_line(dt: type, shape: tuple[int, int]) -> None:
    """``empty_aligned`` / ``zeros_aligned``: every buffer starts on an ``ALIGN``-byte boundary (numba's ``np.empty``
    guarantees 32, so about half of twenty would not), is C-contiguous of the requested shape and of ``like``'s dtype,
    and the zeroed one holds zeros."""
    mods, zeros_ok, last = _aligned_many(shape[0], shape[1], np.zeros(1, dtype=dt), dt(0))
    assert (mods == 0).all(), mods
    assert zeros_ok
    assert last.shape == shape and last.dtype == dt and last.flags.c_contiguous and (last == 19).all()
