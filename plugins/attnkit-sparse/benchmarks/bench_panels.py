"""The register panels (:mod:`attnkit.numba_panel`) at both vector widths, one thread: 256-bit (``<8 x float>``,
4 rows x 2 vectors) against 512-bit (``<16 x float>``, 4 rows x 4 vectors), whichever the CPU; the products
call ``_panels_256`` / ``_panels_512`` directly, so one process times both (a CPU without AVX-512 runs the
512-bit form as two halves).

Products ``OUT += C @ Y`` of the shapes the fused tiles run (routing: 128 keys x 64 queries x 64 dims; lsh's
buckets; linear's 32-position blocks), each called ``--calls`` times on hot operands, median of ``--repeats``.
float32 and float64. GFLOP/s are ``2·rows·terms·columns`` per call::

    python plugins/attnkit-sparse/benchmarks/bench_panels.py

Until session 57 this compared the panels with the sparse engine's axpy tiles (numba loops, 4 rows x 4 terms),
which then moved onto the panels. Nothing here is a test: the figures go to docs/benchmarks.md, "Register panels"
and "Session 57".
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch

from attnkit.numba_panel import PANEL_BITS, _panels_256, _panels_512

SHAPES = [(128, 64, 64), (64, 128, 64), (96, 128, 64), (192, 64, 128), (32, 64, 64)]


@numba.njit(cache=True)
def _calls(OUT, C, Y, n, wide):  # pragma: no cover - compiled
    M, K = C.shape
    N = Y.shape[1]
    for _ in range(n):
        if wide:
            _panels_512(OUT, 0, N, M, C, 0, K, 1, Y, 0, N, K, N, 1)
        else:
            _panels_256(OUT, 0, N, M, C, 0, K, 1, Y, 0, N, K, N, 1)


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
    print(f"# {open('/proc/loadavg').read().split()[:3]} load; numba {numba.__version__}, torch {torch.__version__}; "
          f"PANEL_BITS here {PANEL_BITS}")
    print("| dtype | rows x terms x cols | 256-bit panels GFLOP/s | 512-bit panels GFLOP/s | 512 / 256 |")
    print("|---|---|---:|---:|---:|")
    for dt in (np.float32, np.float64):
        for M, K, N in SHAPES:
            C = rng.standard_normal((M, K)).astype(dt)
            Y = rng.standard_normal((K, N)).astype(dt)
            out = np.zeros((M, N), dt)
            flop = 2.0 * M * K * N * args.calls
            tt = _median(lambda o=out, c=C, y=Y: _calls(o, c, y, args.calls, False), args.repeats)
            tp = _median(lambda o=out, c=C, y=Y: _calls(o, c, y, args.calls, True), args.repeats)
            print(f"| {dt.__name__} | {M} x {K} x {N} | {flop / tt / 1e9:.1f} | {flop / tp / 1e9:.1f} | "
                  f"{tt / tp:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
