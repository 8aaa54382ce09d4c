"""``routing``'s fused CPU attention with and without the forward's saved probability tiles, in one process.

The fused attention (:func:`attnkit_sparse.routing.fused.attend_clusters`) on one routing of random inputs
(float32, B = 1, H = 8, D = 64, ``num_clusters = L / 128``, bidirectional): its forward that keeps the tiles
against the one that does not, the backward that reads them against the one that computes the scores again, and
both together; cases alternated round by round (the order flipped each round), medians (and minima) of
``--rounds``. ``--keep-freed-memory`` calls :func:`attnkit.cpu_memory.keep_freed_memory` first (where the module's
"auto" saves the tiles)::

    python plugins/attnkit-sparse/benchmarks/bench_routing_saved_tiles.py --length 16384 --keep-freed-memory

Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attnkit

B, H, D = 1, 8, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--keep-freed-memory", action="store_true")
    args = ap.parse_args()
    kept = None
    if args.keep_freed_memory:
        from attnkit.cpu_memory import keep_freed_memory
        kept = keep_freed_memory()
    torch.set_num_threads(args.threads)
    import attnkit_sparse.routing.fused as fused
    from attnkit_sparse.routing.clusters import route

    L = args.length
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    rt = attnkit.build("routing", num_clusters=max(1, L // 128), num_heads=H, head_dim=D, backend="numba")
    qi, qok, ki, kok = route(q, k, rt.centroids_for(q), None)[:4]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    g = torch.randn(B, H, L, D)

    def fwd(save: bool) -> torch.Tensor:
        fused.SAVE_TILES = save
        return fused.attend_clusters(*leaves, qi, qok, ki, kok, causal=False, scale=D ** -0.5)

    outs = {s: fwd(s) for s in (False, True)}
    cases = {
        "forward, recompute": lambda: fwd(False),
        "forward, saving the tiles": lambda: fwd(True),
        "backward, recompute": lambda: torch.autograd.grad(outs[False], leaves, g, retain_graph=True),
        "backward, from the saved tiles": lambda: torch.autograd.grad(outs[True], leaves, g, retain_graph=True),
        "forward+backward, recompute": lambda: torch.autograd.grad(fwd(False), leaves, g),
        "forward+backward, saved tiles": lambda: torch.autograd.grad(fwd(True), leaves, g),
    }
    for f in cases.values():
        f()
    ts: dict[str, list[float]] = {n: [] for n in cases}
    for r in range(args.rounds):
        for n in (list(cases) if r % 2 == 0 else list(cases)[::-1]):
            t0 = time.perf_counter()
            cases[n]()
            ts[n].append(time.perf_counter() - t0)
    print(f"# routing fused attention, L = {L}, B = {B}, H = {H}, D = {D}, float32, {args.threads} thread(s), "
          f"keep_freed_memory: {kept}; load {open('/proc/loadavg').read().split()[:3]}")
    for n, x in ts.items():
        print(f"{n:32s} {statistics.median(x) * 1e3:7.1f} ms  (min {min(x) * 1e3:.1f})")


if __name__ == "__main__":
    main()
