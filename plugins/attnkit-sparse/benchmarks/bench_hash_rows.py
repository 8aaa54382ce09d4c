"""``lsh``'s CPU hash, one thread: the form before session 61 (each row of a block's rotations reduced on its own
by ``row_max``, ``row_min`` and ``first_index``) against :func:`attnkit_sparse.lsh._numba.hash_rows` (the rotations
computed transposed, a row per vector lane, :func:`attnkit.numba_vreduce.column_max_min`), and the transposed
product alone (no reduction: what the reduction costs on top of it). Labels checked equal.

L = 16,384 rows of one head (unit vectors, D = 64), 4 rounds of ``half`` buckets a side (128: bucket 64);
median wall time of ``--rounds`` calls of each form, alternated::

    python plugins/attnkit-sparse/benchmarks/bench_hash_rows.py [--length 16384] [--half 128] [--rounds 15]

Nothing here is a test: figures for docs/benchmarks.md ("Session 61").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from attnkit.numba_panel import axpy_at, axpy_t, empty_aligned, transpose, zeros_aligned
from attnkit.numba_vreduce import first_index, row_max, row_min
from attnkit_sparse.engine._numba_kernels import FASTMATH
from attnkit_sparse.lsh._numba import hash_rows


@numba.njit(fastmath=FASTMATH, nogil=True)
def _rows_form(x, rot, C, L, out, g0, g1):  # pragma: no cover - compiled
    """The hash of session 60: a block of 16 rows rotated on the panels, then each row reduced on its own."""
    D = x.shape[1]
    R, _, half = rot.shape
    P = empty_aligned(16, half, x)
    for b0 in range(g0, g1, 16):
        bn = min(16, g1 - b0)
        X = x[b0:b0 + bn]
        for r in range(R):
            for i in range(bn):
                pi = P[i]
                for c in range(half):
                    pi[c] = 0
            axpy_at(P, bn, X, 0, rot[r], 0, D)
            for i in range(bn):
                p = P[i]
                mx = row_max(p)
                mn = row_min(p)
                g = b0 + i
                if mx >= -mn:
                    out[g // L, r, g % L] = first_index(p, mx)
                else:
                    out[g // L, r, g % L] = C + max(first_index(p, mn), 0)
    return out


@numba.njit(fastmath=FASTMATH, nogil=True)
def _product_only(x, rot, C, L, out, g0, g1):  # pragma: no cover - compiled
    """hash_rows' transposed rotations without the reduction."""
    D = x.shape[1]
    R, _, half = rot.shape
    PT = empty_aligned(half, 16, x)
    XT = zeros_aligned(D, 16, x)
    for b0 in range(g0, g1, 16):
        bn = min(16, g1 - b0)
        transpose(XT, x[b0:b0 + bn], bn, D)
        for r in range(R):
            for c in range(half):
                pc = PT[c]
                for i in range(16):
                    pc[i] = 0
            axpy_t(PT, 0, half, rot[r], XT, 0, 0, D)
        out[0, 0, b0] = int(PT[0, 0] > 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--half", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    L, D, R, half = args.length, 64, 4, args.half
    rng = np.random.default_rng(0)
    x = rng.standard_normal((L, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    rot = rng.standard_normal((R, D, half)).astype(np.float32)
    forms = {"rows (session 60)": _rows_form, "transposed (hash_rows)": hash_rows,
             "transposed product alone": _product_only}
    outs = {}
    for name, f in forms.items():
        o = np.zeros((1, R, L), np.int64)
        f(x, rot, half, L, o, 0, L)
        outs[name] = o
    assert np.array_equal(outs["rows (session 60)"], outs["transposed (hash_rows)"])
    times: dict[str, list[float]] = {k: [] for k in forms}
    for r in range(args.rounds):
        for name in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
            o = np.zeros((1, R, L), np.int64)
            t = time.perf_counter()
            forms[name](x, rot, half, L, o, 0, L)
            times[name].append(time.perf_counter() - t)
    print(f"# lsh hash, one head: L = {L}, D = {D}, {R} rounds of {half} buckets a side, float32, one thread, "
          f"median of {args.rounds} (labels equal)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>26}: {med * 1e3:6.2f} ms  ({med / (L * R) * 1e9:5.1f} ns a row and round)")


if __name__ == "__main__":
    main()
