"""Where ``routing``'s and ``sinkhorn``'s CPU (numba) paths spend their time: parts timed on their own, alternated.

routing (``num_clusters = L / 128``): the routing (scores against the centroids, each cluster's top-w, eval:
no nearest centroid), the fused attention forward and backward (:mod:`attnkit_sparse.routing.fused`), the
commitment term and EMA (training), the whole eval forward and train forward+backward. sinkhorn (blocks of 64,
8 iterations): the sorting matrix (forward, forward+backward), the own and sorted blocks of k (forward), the
engine's attention forward, the whole eval forward and train forward+backward. float32, B = 1, H = 8, D = 64,
medians (and minima) of ``--repeats`` rounds; ``--cpu-time`` reports ``time.process_time`` (use it at 1 thread
on a shared machine)::

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/profile_content_parts.py \\
        --length 16384 --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import attnkit
from attnkit_sparse.routing.clusters import route
from attnkit_sparse.routing.fused import attend_clusters
from attnkit_sparse.sinkhorn.sorting import own_and_sorted

B, H, D = 1, 8, 64


def parts(L: int) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    rt = attnkit.build("routing", num_clusters=max(1, L // 128), num_heads=H, head_dim=D, backend="numba")
    sk = attnkit.build("sinkhorn", block_size=64, num_heads=H, head_dim=D, backend="numba")
    mu = rt.centroids_for(q)
    qi, qok, ki, kok, near = route(q, k, mu, None, nearest=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend_clusters(*leaves, qi, qok, ki, kok, causal=False, scale=D ** -0.5)
    g = torch.ones_like(out)
    s = sk.sort_matrix(k, causal=False)

    def train_step(m: torch.nn.Module) -> None:
        m.train()
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        m(*xs).backward(g)
        attnkit.aux_losses(m)                         # collect (and drop) the recorded auxiliary loss

    def eval_step(m: torch.nn.Module) -> None:
        m.eval()
        with torch.no_grad():
            m(q, k, v)

    def sort_fb() -> None:
        kk = k.clone().requires_grad_()
        sk.sort_matrix(kk, causal=False).sum().backward()

    def update() -> None:
        rt._update(q, k, None, near, rt.centroids_for(q).clone())
        attnkit.aux_losses(rt)

    return {
        "routing: route (eval)": lambda: route(q, k, mu, None),
        "routing: attention fwd": lambda: attend_clusters(q, k, v, qi, qok, ki, kok, causal=False, scale=D ** -0.5),
        "routing: attention bwd": lambda: torch.autograd.grad(out, leaves, g, retain_graph=True),
        "routing: commitment + EMA": update,
        "routing: eval forward": lambda: eval_step(rt),
        "routing: train fwd+bwd": lambda: train_step(rt),
        "sinkhorn: sort matrix (eval)": lambda: sk.eval().sort_matrix(k, causal=False),
        "sinkhorn: sort matrix fwd+bwd": sort_fb,
        "sinkhorn: own and sorted k": lambda: own_and_sorted(k, s, 64),
        "sinkhorn: eval forward": lambda: eval_step(sk),
        "sinkhorn: train fwd+bwd": lambda: train_step(sk),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="time.process_time instead of perf_counter")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    table = parts(args.length)
    print(f"# load {open('/proc/loadavg').read().split()[:3]}, L = {args.length}, {args.threads} threads, "
          f"{'CPU' if args.cpu_time else 'wall'} time", flush=True)
    ts: dict[str, list[float]] = {name: [] for name in table}
    for f in table.values():
        f()
    for _ in range(args.repeats):
        for name, f in table.items():
            t0 = clock()
            f()
            ts[name].append(clock() - t0)
    for name, x in ts.items():
        print(f"{name:32s} {sorted(x)[len(x) // 2] * 1e3:8.1f} ms  (min {min(x) * 1e3:.1f})")
    print(f"# load at the end {open('/proc/loadavg').read().split()[:3]}", flush=True)


if __name__ == "__main__":
    main()
