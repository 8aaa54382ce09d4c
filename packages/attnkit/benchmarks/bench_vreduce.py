"""The largest entry of a row, and the first position of a value, in the forms the kernels used and in
:mod:`attnkit.numba_vreduce` (session 58).

* ``select``: ``m = x if x > m else m`` over the row (the performer's training features, routing's select);
* ``fmax``: ``m = np.fmax(m, x)`` over the row;
* ``lanes``: 16 running maxima in an array, updated by ``np.fmax`` (the performer's fused forward before);
* ``row_max``: :func:`attnkit.numba_vreduce.row_max` (four running vectors by ``llvm.maxnum``);
* ``argmax scan``: ``lsh``'s hash before, one pass keeping the first maximum and the first minimum and their
  positions, against ``row_max`` + ``row_min`` + :func:`~attnkit.numba_vreduce.first_index` for the winner.

One thread, hot operands (rows of ``--length``, 32 rows, float32 unless ``--float64``); nanoseconds per element,
median of ``--rounds`` rounds, the forms alternated in each round. Each form's result is checked against NumPy.

    python packages/attnkit/benchmarks/bench_vreduce.py [--length 256] [--rounds 7] [--float64]

Nothing here is a test: figures for docs/benchmarks.md ("Session 58").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from attnkit.numba_vreduce import first_index, row_max, row_min

_FM = {"reassoc", "contract", "nsz"}       # the plugins' kernels' flags: no nnan


@numba.njit(fastmath=_FM)
def _select(X, reps):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], X.dtype)
    for _ in range(reps):
        for r in range(X.shape[0]):
            row = X[r]
            m = row[0]
            for j in range(row.shape[0]):
                m = row[j] if row[j] > m else m
            out[r] = m
    return out


@numba.njit(fastmath=_FM)
def _fmax(X, reps):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], X.dtype)
    for _ in range(reps):
        for r in range(X.shape[0]):
            row = X[r]
            m = row[0]
            for j in range(row.shape[0]):
                m = np.fmax(m, row[j])
            out[r] = m
    return out


@numba.njit(fastmath=_FM)
def _lanes(X, reps):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], X.dtype)
    lanes = np.empty(16, X.dtype)
    for _ in range(reps):
        for r in range(X.shape[0]):
            row = X[r]
            n = row.shape[0]
            for i in range(16):
                lanes[i] = row[0]
            nl = n - n % 16
            for b in range(0, nl, 16):
                seg = row[b:]
                for i in range(16):
                    lanes[i] = np.fmax(lanes[i], seg[i])
            m = row[0]
            for i in range(16):
                m = np.fmax(m, lanes[i])
            for j in range(nl, n):
                m = np.fmax(m, row[j])
            out[r] = m
    return out


@numba.njit(fastmath=_FM)
def _row_max(X, reps):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], X.dtype)
    for _ in range(reps):
        for r in range(X.shape[0]):
            out[r] = row_max(X[r])
    return out


@numba.njit(fastmath=_FM)
def _scan(X, reps):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], np.int64)
    C = X.shape[1]
    for _ in range(reps):
        for r in range(X.shape[0]):
            p = X[r]
            mx = p[0]
            mn = p[0]
            amx = 0
            amn = 0
            for c in range(1, C):
                v = p[c]
                if v > mx:
                    mx = v
                    amx = c
                if v < mn:
                    mn = v
                    amn = c
            out[r] = amx if mx >= -mn else C + amn
    return out


@numba.njit(fastmath=_FM)
def _vector_scan(X, reps):  # pragma: no cover - compiled
    out = np.empty(X.shape[0], np.int64)
    C = X.shape[1]
    for _ in range(reps):
        for r in range(X.shape[0]):
            p = X[r]
            mx = row_max(p)
            mn = row_min(p)
            out[r] = first_index(p, mx) if mx >= -mn else C + max(first_index(p, mn), 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--float64", action="store_true")
    args = ap.parse_args()
    dt = np.float64 if args.float64 else np.float32
    X = np.random.default_rng(0).standard_normal((32, args.length)).astype(dt)
    reps = max(1, 20_000_000 // X.size)
    want_max = X.max(axis=1)
    want_arg = np.where(X.max(axis=1) >= -X.min(axis=1), X.argmax(axis=1), args.length + X.argmin(axis=1))
    forms = {"select": _select, "fmax": _fmax, "lanes": _lanes, "row_max": _row_max,
             "argmax scan": _scan, "row_max + row_min + first_index": _vector_scan}
    for name, f in forms.items():       # compile, and check
        got = f(X, 1)
        want = want_arg if "scan" in name or "first" in name else want_max
        assert np.array_equal(got, want), name
    times: dict[str, list[float]] = {k: [] for k in forms}
    for r in range(args.rounds):
        order = list(forms) if r % 2 == 0 else list(forms)[::-1]
        for name in order:
            t = time.perf_counter()
            forms[name](X, reps)
            times[name].append((time.perf_counter() - t) / (reps * X.size) * 1e9)
    print(f"# rows of {args.length}, {np.dtype(dt).name}, one thread, {args.rounds} rounds; ns per element (median)")
    for name in forms:
        print(f"{name:>34}: {statistics.median(times[name]):.3f}")


if __name__ == "__main__":
    main()
