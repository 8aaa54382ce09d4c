"""Loop forms the plugins' numba kernels use, timed against the forms that replaced them (session 42).

* a running maximum over rows, ``m[i] = x if x > m[i] else m[i]`` (LLVM vectorises it into masked stores) against
  ``m[i] = np.fmax(m[i], x)`` and against the same select written into another array;
* a tile mask, ``if not keep[j]: s[j] = -inf`` over a query-major mask read along key-major scores (the engine's
  form before) against ``s[j] = fmin(s[j], NaN if keep[j] else -inf)`` over a key-major mask;
* a block of key features transposed, ``(32, 256) -> (256, 32)``: the numba loop that gathers a column against
  :func:`attnkit.numba_panel.transpose` (8 x 8 tiles through registers).

One thread, float32, hot operands (every form runs on one small block many times); nanoseconds per element,
median of ``--rounds`` rounds, the forms alternated in each round. The masked-store count of each form's machine
code is printed beside it (0 where LLVM emitted none).

    python packages/attnkit/benchmarks/bench_store_patterns.py [--rounds 7]

Nothing here is a test: figures for docs/benchmarks.md ("Session 42").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from attnkit.numba_panel import transpose


@numba.njit
def _max_select(rows, m, reps):  # pragma: no cover - compiled
    for _ in range(reps):
        for r in range(rows.shape[0]):
            row = rows[r]
            for i in range(m.shape[0]):
                x = row[i]
                m[i] = x if x > m[i] else m[i]


@numba.njit
def _max_fmax(rows, m, reps):  # pragma: no cover - compiled
    for _ in range(reps):
        for r in range(rows.shape[0]):
            row = rows[r]
            for i in range(m.shape[0]):
                m[i] = np.fmax(m[i], row[i])


@numba.njit
def _max_other_array(rows, m, m2, reps):  # pragma: no cover - compiled
    for _ in range(reps):
        for r in range(rows.shape[0]):
            row = rows[r]
            for i in range(m.shape[0]):
                x = row[i]
                m2[i] = x if x > m[i] else m[i]


@numba.njit
def _mask_conditional(ST, bank, reps):  # pragma: no cover - compiled
    ninf = np.float32(-np.inf)
    kn, qn = ST.shape
    for _ in range(reps):
        for i in range(qn):
            b = bank[i]
            for j in range(kn):
                if not b[j]:
                    ST[j, i] = ninf


@numba.njit
def _mask_fmin(ST, bankT, reps):  # pragma: no cover - compiled
    drop = np.float32(-np.inf)
    keep = drop - drop
    kn, qn = ST.shape
    for _ in range(reps):
        for j in range(kn):
            r = ST[j]
            b = bankT[j]
            for i in range(qn):
                r[i] = np.fmin(r[i], keep if b[i] else drop)


@numba.njit
def _transpose_loop(OUT, X, reps):  # pragma: no cover - compiled
    T, M = X.shape
    for _ in range(reps):
        for j in range(M):
            d = OUT[j]
            for t in range(T):
                d[t] = X[t, j]


@numba.njit
def _transpose_tiles(OUT, X, reps):  # pragma: no cover - compiled
    for _ in range(reps):
        transpose(OUT, X, X.shape[0], X.shape[1])


def _masked_stores(fn) -> int:  # noqa: ANN001
    asm = fn.inspect_asm(fn.signatures[0])
    return sum(1 for line in asm.splitlines() if "maskmov" in line and line.strip().endswith(")"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((32, 256)).astype(np.float32)
    m, m2 = np.full(256, -np.inf, np.float32), np.empty(256, np.float32)
    ST = rng.standard_normal((64, 64)).astype(np.float32)
    bank = rng.random((64, 64)) < 0.5
    bankT = np.ascontiguousarray(bank.T)
    X = rng.standard_normal((32, 256)).astype(np.float32)
    OUT = np.empty((256, 32), np.float32)
    cases = {
        "running max, select into the same array": (_max_select, (rows, m), rows.size),
        "running max, np.fmax": (_max_fmax, (rows, m), rows.size),
        "running max, select into another array": (_max_other_array, (rows, m, m2), rows.size),
        "tile mask, conditional store (query-major mask)": (_mask_conditional, (ST, bank), ST.size),
        "tile mask, fmin store (key-major mask)": (_mask_fmin, (ST, bankT), ST.size),
        "transpose (32, 256), numba loop": (_transpose_loop, (OUT, X), X.size),
        "transpose (32, 256), register tiles": (_transpose_tiles, (OUT, X), X.size),
    }
    reps = 2000
    for fn, a, _ in cases.values():
        fn(*a, 1)                                   # compile
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (fn, a, n) in cases.items():
            t0 = time.perf_counter()
            fn(*a, reps)
            times[name].append((time.perf_counter() - t0) / reps / n * 1e9)
    print("| form | ns / element | masked stores in its code |")
    print("|---|---:|---:|")
    for name, (fn, _, _) in cases.items():
        print(f"| {name} | {statistics.median(times[name]):.3f} | {_masked_stores(fn)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
