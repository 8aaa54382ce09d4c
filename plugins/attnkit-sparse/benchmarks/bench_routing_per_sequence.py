"""``routing`` on CPU: the per-sequence routing kernel against torch's product over all sequences, in one process.

The two ways :mod:`attnkit_sparse.routing.clusters` routes on CPU (``PER_SEQUENCE`` True or False: one kernel call
per sequence computing its scores on register panels, its nearest centroids and its selection, against torch's
product into a buffer followed by the nearest-centroid and selection kernels) are called alternately in every round
(the order flipped each round), so a change of the machine's speed during the run hits both alike. Reported: the
medians of each and the median (and quartiles) of the per-round ratios ``product / per-sequence``, for ``route``
alone (queries and keys, with nearest centroids), the module's eval forward and its training step
(forward + backward). float32, B = 1, H = 8, D = 64, ``num_clusters = L / 128``::

    python plugins/attnkit-sparse/benchmarks/bench_routing_per_sequence.py --length 16384 --threads 2 --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attnkit
import attnkit_sparse.routing.clusters as clusters

B, H, D = 1, 8, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    L = a.length
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    m = attnkit.build("routing", num_clusters=max(1, L // 128), num_heads=H, head_dim=D, backend="numba")
    mu = m.centroids_for(q)
    g = torch.ones(B, H, L, D)

    def route() -> None:
        clusters.route(q, k, mu, None, nearest=True)

    def eval_forward() -> None:
        m.eval()
        with torch.no_grad():
            m(q, k, v)

    def train_step() -> None:
        m.train()
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        m(*xs).backward(g)
        attnkit.aux_losses(m)

    print(f"# L = {L}, {a.threads} threads, {a.rounds} rounds (the first dropped), float32, B = {B}, H = {H}, D = {D}")
    for name, f in (("route (q and k, nearest)", route), ("eval forward", eval_forward), ("train step", train_step)):
        t: dict[bool, list[float]] = {True: [], False: []}
        for r in range(a.rounds):
            for per_seq in ((True, False) if r % 2 else (False, True)):
                clusters.PER_SEQUENCE = per_seq
                t0 = time.perf_counter()
                f()
                t[per_seq].append(time.perf_counter() - t0)
        ratios = [b / s for b, s in zip(t[False][1:], t[True][1:])]
        qs = statistics.quantiles(ratios, n=4)
        prod, per = (1e3 * statistics.median(t[x][1:]) for x in (False, True))
        print(f"{name:26s} product {prod:7.1f} ms   per-sequence {per:7.1f} ms   product / per-sequence "
              f"{statistics.median(ratios):.3f}x (quartiles {qs[0]:.3f}-{qs[2]:.3f})")
    clusters.PER_SEQUENCE = "auto"


if __name__ == "__main__":
    main()
