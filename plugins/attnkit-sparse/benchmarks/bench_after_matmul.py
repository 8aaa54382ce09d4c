"""The sparse engine's numba forward timed right after a torch matmul, and after a pause, in one process.

After a torch operation on torch's OpenMP pool, the pool's idle worker spins for a few milliseconds; kernels whose
threads are not that pool's share the cores with it (docs/benchmarks.md, "CI time, session 40"). Per call: a
``(L, 512) @ (512, 512)`` matmul, then (or after a 50 ms pause) ``local`` window 256, causal, no grad, B = 1, H = 8,
D = 64, float32, torch on ``--threads``. Prints the median of each. ``--tree`` runs another checkout's sources
(a worktree of an older revision) instead of the installed ones; run the two alternately, one process each::

    python plugins/attnkit-sparse/benchmarks/bench_after_matmul.py --length 1024
    python plugins/attnkit-sparse/benchmarks/bench_after_matmul.py --length 1024 --tree /tmp/old

Nothing here is a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=21)
    p.add_argument("--tree", help="a checkout whose packages/attnkit/src and plugins/attnkit-sparse/src to import")
    args = p.parse_args()
    if args.tree:
        sys.path[:0] = [f"{args.tree}/packages/attnkit/src", f"{args.tree}/plugins/attnkit-sparse/src"]
    import torch

    import attnkit

    torch.set_num_threads(args.threads)
    L = args.length
    m = attnkit.build("local", window=256, backend="numba")
    x, w = torch.randn(L, 512), torch.randn(512, 512)
    q, k, v = (torch.randn(1, 8, L, 64) for _ in range(3))

    def run(pause: bool) -> float:
        x @ w
        if pause:
            time.sleep(0.05)
        t = time.perf_counter()
        with torch.no_grad():
            m(q, k, v, causal=True)
        return time.perf_counter() - t

    for _ in range(3):
        run(False)
    ts: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.calls):
        for pause in ts:
            ts[pause].append(run(pause))
    print(f"{args.tree or 'installed'} L={L}: after a matmul {statistics.median(ts[False]) * 1e3:.2f} ms, "
          f"after a pause {statistics.median(ts[True]) * 1e3:.2f} ms (medians of {args.calls})")


if __name__ == "__main__":
    main()
