"""Where the time of one engine call goes on a CUDA GPU: host (Python, plan, launches) against device kernels.

Runs the causal 256-key window (block 64, triton backend) forward and forward+backward at a few lengths,
warm, then profiles a few calls with ``torch.profiler`` and prints, per length and mode:

* the wall time of one call (host, synchronised) and the summed device-kernel time per call, so a gap
  between them is host overhead (Python, plan lookups, launches, allocations), not kernels;
* the kernels and host ops that take the most time (``key_averages``).

    python plugins/attnkit-sparse/benchmarks/profile_gpu.py --lengths 1024 4096 16384 --out profile.txt
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from attnkit import masks
from attnkit_sparse.engine import attend

B, H, D, WINDOW = 1, 8, 64, 256


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rows", type=int, default=15, help="rows of each profiler table")
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    mask = masks.causal() & masks.sliding_window(WINDOW - 1)
    lines: list[str] = [f"{torch.cuda.get_device_name()} torch {torch.__version__} {args.dtype} "
                        f"block {args.block_size}"]
    for L in args.lengths:
        g = torch.Generator(device="cpu").manual_seed(L)
        xs = [torch.randn(B, H, L, D, generator=g).to(dev, dtype).requires_grad_(True) for _ in range(3)]
        go = torch.randn_like(xs[0])

        def fwd(xs=xs):
            with torch.no_grad():
                return attend(*xs, mask, backend="triton", block_size=args.block_size)

        def fwdbwd(xs=xs, go=go):
            out = attend(*xs, mask, backend="triton", block_size=args.block_size)
            return torch.autograd.grad(out, xs, go)

        for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.iters * 1e3
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            host = (time.perf_counter() - t0) / args.iters * 1e3       # no sync: host time to issue one call
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    fn()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            dev_us = sum(e.self_device_time_total for e in ev) / args.iters
            lines.append(f"\n== L={L} {mode}: wall {wall:.3f} ms/call (synchronised), host issue {host:.3f} ms/call, "
                         f"device kernels {dev_us / 1e3:.3f} ms/call, kernel launches/call "
                         f"{sum(e.count for e in ev if e.self_device_time_total > 0) / args.iters:.1f}")
            lines.append(ev.table(sort_by="self_cuda_time_total", row_limit=args.rows))
            lines.append(ev.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        del xs, go, fwd, fwdbwd
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
