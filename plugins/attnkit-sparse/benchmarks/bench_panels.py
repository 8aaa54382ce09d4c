"""The register panels (:mod:`attnkit.numba_panel`) against the engine's axpy tiles, one thread.

Products ``OUT += C @ Y`` of the shapes the fused tiles run (routing: 128 keys x 64 queries x 64 dims; lsh's
buckets; linear's 32-position blocks), each called ``--calls`` times on hot operands, median of ``--repeats``.
float32 and float64. GFLOP/s are ``2·rows·terms·columns`` per call::

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/bench_panels.py

Nothing here is a test: the figures go to docs/benchmarks.md, "Register panels".
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch

from attnkit.numba_panel import axpy_at
from attnkit_sparse.engine._numba_kernels import _axpy_at

SHAPES = [(128, 64, 64), (64, 128, 64), (96, 128, 64), (192, 64, 128), (32, 64, 64)]


@numba.njit(cache=True)
def _calls_panel(OUT, C, Y, n):  # pragma: no cover - compiled
    for _ in range(n):
        axpy_at(OUT, OUT.shape[0], C, 0, Y, 0, Y.shape[0])


@numba.njit(cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _calls_tiles(OUT, C, Y, n):  # pragma: no cover - compiled
    for _ in range(n):
        _axpy_at(OUT, OUT.shape[0], C, 0, Y, 0, Y.shape[0])


def _median(f, repeats: int) -> float:  # noqa: ANN001
    f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"# {open('/proc/loadavg').read().split()[:3]} load; numba {numba.__version__}, torch {torch.__version__}")
    print("| dtype | rows x terms x cols | axpy tiles GFLOP/s | panels GFLOP/s | panels / tiles |")
    print("|---|---|---:|---:|---:|")
    for dt in (np.float32, np.float64):
        for M, K, N in SHAPES:
            C = rng.standard_normal((M, K)).astype(dt)
            Y = rng.standard_normal((K, N)).astype(dt)
            out = np.zeros((M, N), dt)
            flop = 2.0 * M * K * N * args.calls
            tt = _median(lambda o=out, c=C, y=Y: _calls_tiles(o, c, y, args.calls), args.repeats)
            tp = _median(lambda o=out, c=C, y=Y: _calls_panel(o, c, y, args.calls), args.repeats)
            print(f"| {dt.__name__} | {M} x {K} x {N} | {flop / tt / 1e9:.1f} | {flop / tp / 1e9:.1f} | "
                  f"{tt / tp:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
