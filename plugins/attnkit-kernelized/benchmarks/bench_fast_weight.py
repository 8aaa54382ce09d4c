"""Benchmark ``fast-weight`` (the delta rule): the chunked UT-transform form against its token loops.

CPU, float32, (B, H, D) = (1, 8, 64), the default feature map (DPFP, M = 128
features), learned beta, causal; forward (under ``torch.no_grad``) and
forward+backward (``out.sum().backward()``), for

* ``chunked-C<n>``: the module on the ``torch`` backend (chunked UT-transform
  form, :mod:`attnkit_kernelized.fast_weight.chunk`) with ``chunk_size = n``,
* ``numba``: the module on the ``numba`` backend (the chunked form on register panels, fused with the
  feature map without autograd; the backward by the per-position recurrence from checkpoints; called
  ``loop-numba`` before session 64, when its forward was that recurrence too),
* ``loop-torch``: the module's step form (:func:`recurrent.delta_rule_step`, a
  Python loop over positions of torch operations, autograd backward),
* ``auto``: the module with ``backend="auto"`` (what a user gets),
* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` on the same q, k, v.

Every method runs once per round, the order rotated each round; the first
``--warmup`` rounds are dropped and the median of the rest is reported, with
every ratio taken within the same run. ``uptime`` is printed before and after
(the machine may be shared). The float32 matmul rate (1024^3 products) is
measured in the same run. Nothing here is a test.

Usage::

    flock /tmp/attnkit-bench.lock python plugins/attnkit-kernelized/benchmarks/bench_fast_weight.py \\
        --lengths 2048 8192 --repeats 3 --warmup 1 --output fast_weight.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import attnkit


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:  # pragma: no cover - no uptime binary
        return "uptime unavailable"


def matmul_rate(seconds: float = 2.0, n: int = 1024) -> float:
    """float32 matmul FLOP/s at torch's thread count (median of repeated n^3 products)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def methods(args: argparse.Namespace) -> dict:
    common = dict(num_heads=args.heads, head_dim=args.dim)

    def module(backend: str, **opts):
        torch.manual_seed(0)   # the same beta projection for every method
        return attnkit.build("fast-weight", backend=backend, **common, **opts)

    out = {}
    for c in args.chunks:
        mod = module("torch", chunk_size=c)
        out[f"chunked-C{c}"] = (lambda m: lambda q, k, v: m(q, k, v, causal=True))(mod)
    numba_mod = module("numba")
    out["numba"] = lambda q, k, v: numba_mod(q, k, v, causal=True)
    step_mod = module("torch")

    def loop_torch(q, k, v):
        o, _ = step_mod.step(q, k, v, step_mod.init_state(q.shape[0], dtype=q.dtype))
        return o

    out["loop-torch"] = loop_torch
    auto_mod = module("auto")
    out["auto"] = lambda q, k, v: auto_mod(q, k, v, causal=True)
    out["sdpa"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if args.only:
        out = {n: f for n, f in out.items() if n in args.only}
    return out


def run_once(fn, L: int, args: argparse.Namespace, backward: bool) -> float:
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(args.batch, args.heads, L, args.dim, generator=g) for _ in range(3))
    if backward:
        for x in (q, k, v):
            x.requires_grad_()
        t = time.perf_counter()
        fn(q, k, v).sum().backward()
        return time.perf_counter() - t
    with torch.no_grad():
        t = time.perf_counter()
        fn(q, k, v)
        return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--only", nargs="*", help="method names to keep")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--output", help="write the medians (JSON) here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"uptime before: {uptime()}", flush=True)
    print(f"command: python {' '.join(sys.argv)}", flush=True)
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.processor()
            or platform.machine(), "uptime_before": uptime()}
    info["matmul_flops_per_s"] = rate = matmul_rate()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 matmul rate "
          f"{rate / 1e9:.1f} GFLOP/s", flush=True)
    fns = methods(args)
    names = list(fns)
    results = []
    for mode in args.modes:
        for L in args.lengths:
            times = {n: [] for n in names}
            for r in range(args.warmup + args.repeats):
                order = names[r % len(names):] + names[:r % len(names)]
                for n in order:
                    t = run_once(fns[n], L, args, mode == "fwdbwd")
                    if r >= args.warmup:
                        times[n].append(t)
            med = {n: statistics.median(ts) for n, ts in times.items()}
            results.append({"mode": mode, "L": L, "median_s": med, "all_s": times})
            print(f"\n{mode} L={L}: median seconds ({args.repeats} rounds, {args.warmup} warm-up dropped)", flush=True)
            for n in names:
                ratios = "  ".join(f"{b}/this={med[b] / med[n]:.2f}x" for b in ("numba", "loop-torch", "sdpa")
                                   if b in med and b != n)
                print(f"  {n:12s} {med[n]:9.4f}  {ratios}", flush=True)
    info["uptime_after"] = uptime()
    print(f"\nuptime after: {info['uptime_after']}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"info": info, "args": vars(args), "results": results}, f, indent=1)
        print(f"wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
