"""Peak memory per rank of context parallelism (``attnkit.context_parallel``) against one process.

For each mechanism (``linear``, causal; ``local`` with a 256-key window) and each world size, spawns
that many gloo CPU processes; each creates only its own chunk of a float32 ``(B, H, L, D)`` sequence
and runs one forward and backward through :func:`attnkit.context_parallel.context_parallel`. The
figure is the growth of the process's peak resident set (``ru_maxrss``) over its value just before
the run (after imports and a small warm-up that loads the kernels), the largest over ranks, with the
time of the forward+backward (median of ranks). World 1 runs the plain ``forward`` in one process.

    python packages/attnkit/benchmarks/context_parallel_memory.py --length 32768 --worlds 1 2 4

Needs attnkit-kernelized and attnkit-sparse installed. Times on a machine with fewer cores than ranks
measure contention, not scaling; the memory figure is the point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MECHANISMS = {"linear": {}, "local": {"window": 256}}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _worker(rank: int, world: int, init_file: str, outdir: str, name: str, L: int, B: int, H: int, D: int) -> None:
    import attnkit
    from attnkit.context_parallel import chunk_bounds, context_parallel

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    attn = attnkit.build(name, **MECHANISMS[name])
    small = [torch.randn(B, H, 8, D, requires_grad=True) for _ in range(3)]
    attn(*small, causal=True).sum().backward()          # warm-up: loads cached numba kernels
    start, stop = chunk_bounds(L, world)[rank]
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, H, stop - start, D, generator=g).requires_grad_() for _ in range(3))
    before = _rss_mib()
    t0 = time.perf_counter()
    out = context_parallel(attn, q, k, v, causal=True) if world > 1 else attn(q, k, v, causal=True)
    out.sum().backward()
    elapsed = time.perf_counter() - t0
    peak = _rss_mib()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
        json.dump({"chunk": stop - start, "growth_mib": peak - before, "seconds": elapsed}, fh)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mechanisms", nargs="+", default=list(MECHANISMS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = []
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, load {os.getloadavg()[0]:.2f}; L={args.length} B={args.batch} "
          f"H={args.heads} D={args.head_dim} float32, forward+backward, 1 thread per rank")
    print("| mechanism | ranks | positions per rank | peak RSS growth per rank (max) | vs 1 rank "
          "| fwd+bwd s (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.mechanisms:
        base = None
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_worker, args=(world, os.path.join(tmp, "rdv"), tmp, name, args.length, args.batch,
                                        args.heads, args.head_dim), nprocs=world)
                res = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]
            growth = max(r["growth_mib"] for r in res)
            secs = statistics.median(r["seconds"] for r in res)
            base = growth if base is None else base
            rows.append({"mechanism": name, "world": world, "chunk": res[0]["chunk"], "growth_mib": growth,
                         "seconds": secs})
            print(f"| {name} | {world} | {res[0]['chunk']:,} | {growth:,.0f} MiB | {growth / base:.2f}x | "
                  f"{secs:.2f} |", flush=True)
    print(f"# load after {os.getloadavg()[0]:.2f}; command: {' '.join(sys.argv)}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
