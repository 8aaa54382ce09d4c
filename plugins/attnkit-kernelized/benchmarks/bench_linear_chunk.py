"""Chunk size of causal ``linear`` on the ``torch`` backend, measured: time and fraction of the matmul rate.

CPU, float32, (B, H, D) = (1, 8, 64), ``elu+1`` features (M = D = 64), causal,
forward under ``torch.no_grad``; ``chunk_size`` in ``--chunks`` and the
``numba`` backend beside them, interleaved (every method once per round, order
rotated), first ``--warmup`` rounds dropped, median of the rest. Useful FLOPs
are counted as in docs/benchmarks.md, ``4·B·H·L·D·E`` (state update and
read-out), and divided by the float32 matmul rate (1024^3 products) measured in
the same run. Nothing here is a test.

Usage::

    flock /tmp/attnkit-bench.lock python plugins/attnkit-kernelized/benchmarks/bench_linear_chunk.py \\
        --length 8192 --chunks 32 64 128 256 --output linear_chunk.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import attnkit


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def matmul_rate(seconds: float = 2.0, n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int)
    p.add_argument("--output")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"uptime before: {uptime()}\ncommand: python {' '.join(sys.argv)}", flush=True)
    rate = matmul_rate()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 matmul rate {rate / 1e9:.1f} GFLOP/s",
          flush=True)
    common = dict(num_heads=args.heads, head_dim=args.dim)
    mods = {f"torch-C{c}": attnkit.build("linear", backend="torch", chunk_size=c, **common) for c in args.chunks}
    mods["numba"] = attnkit.build("linear", backend="numba", **common)
    names = list(mods)
    L, B, H, D = args.length, 1, args.heads, args.dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    times = {n: [] for n in names}
    with torch.no_grad():
        for r in range(args.warmup + args.repeats):
            for n in names[r % len(names):] + names[:r % len(names)]:
                t = time.perf_counter()
                mods[n](q, k, v, causal=True)
                if r >= args.warmup:
                    times[n].append(time.perf_counter() - t)
    flops = 4 * B * H * L * D * D
    rows = {}
    print(f"\nforward L={L}: median seconds, useful FLOPs 4·B·H·L·D·E / matmul rate", flush=True)
    for n in names:
        med = statistics.median(times[n])
        rows[n] = {"median_s": med, "fraction_of_matmul_rate": flops / med / rate, "all_s": times[n]}
        print(f"  {n:10s} {med:8.4f} s  {100 * flops / med / rate:5.1f}%", flush=True)
    after = uptime()
    print(f"\nuptime after: {after}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "matmul_flops_per_s": rate, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "uptime_after": after, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
