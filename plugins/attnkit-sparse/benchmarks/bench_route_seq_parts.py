"""Where ``routing``'s per-sequence routing kernel (:func:`attnkit_sparse.routing._numba.route_seq`) spends its time.

One sequence (L positions, D = 64, ``num_clusters = L / 128``, random unit centroids, float32), one thread, the
kernel called directly (no Python per cluster), in three forms alternated round by round:

* ``full``: scores, nearest centroids and each cluster's selection (what the training forward runs per side);
* ``no nearest``: scores and selection (the eval forward);
* ``scores only``: every cluster's width set to 0, so nothing is selected: the score product on the register
  panels, the inverse norms and the scores written to the sequence's buffer (the short-row path).

``full - no nearest`` is the nearest-centroid part. Since session 44 long rows never write their scores (the
sample positions are scored first, and each tile's candidates are kept while it is in cache), so
``no nearest - scores only`` is the selection less the writing of the scores; before, it was the selection
alone. Medians of ``--rounds`` (after one warm-up call each)::

    python plugins/attnkit-sparse/benchmarks/bench_route_seq_parts.py --length 16384 --rounds 21

Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from attnkit_sparse.routing._numba import route_seq

H, D = 8, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=21)
    a = ap.parse_args()
    L = a.length
    C = max(1, L // 128)
    W = -(-L // C)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((H, L, D)).astype(np.float32)
    mu = rng.standard_normal((H, C, D)).astype(np.float32)
    mu /= np.linalg.norm(mu, axis=-1, keepdims=True)
    real = np.ones((1, L), dtype=np.bool_)
    s = np.empty((H, C, L), dtype=np.float32)
    inv = np.empty((H, L), dtype=np.float32)
    near = np.empty((H, L), dtype=np.int64)
    forms = {
        "full": (np.array([W]), near),
        "no nearest": (np.array([W]), np.empty((0, 0), dtype=np.int64)),
        "scores only": (np.array([0]), np.empty((0, 0), dtype=np.int64)),
    }

    def once(widths: np.ndarray, nr: np.ndarray) -> float:
        idx, ok = np.zeros((H, C, W), dtype=np.int64), np.zeros((H, C, W), dtype=np.bool_)
        t = time.perf_counter()
        route_seq(x, mu, real, H, widths, W, 0, s, inv, nr, idx, ok)
        return time.perf_counter() - t

    for f in forms.values():
        once(*f)
    ts: dict[str, list[float]] = {name: [] for name in forms}
    for r in range(a.rounds):
        names = list(forms) if r % 2 == 0 else list(reversed(forms))
        for name in names:
            ts[name].append(once(*forms[name]))
    med = {name: statistics.median(t) * 1e3 for name, t in ts.items()}
    print(f"# route_seq, one sequence, L = {L}, {C} clusters of {W}, D = {D}, float32, one thread, "
          f"medians of {a.rounds}")
    for name, m in med.items():
        print(f"{name:12s} {m:7.3f} ms")
    print(f"nearest      {med['full'] - med['no nearest']:7.3f} ms (full - no nearest)")
    print(f"selection    {med['no nearest'] - med['scores only']:7.3f} ms (no nearest - scores only)")


if __name__ == "__main__":
    main()
