"""CPU benchmark of the content-based sparse mechanisms (lsh, routing, sinkhorn) against SDPA.

Case (issue 11): float32, B=1, H=8, D=64, self-attention, bidirectional, L in ``--lengths``. In one run,
on this machine:

* ``sdpa``: dense ``scaled_dot_product_attention`` (skipped above ``--dense-max``);
* ``lsh``: 4 hash rounds, bucket 64 (``--n-hashes``, ``--bucket-size``), shared-QK (``k = q``), on the
  engine's numba kernels (``lsh-numba``) and its plain-torch block-gather path (``lsh-torch``);
* ``routing``: ``num_clusters = L / --routing-window`` (each cluster routes that many queries and keys);
* ``sinkhorn``: ``--block-size`` 64.

Forward (``torch.no_grad``) and forward+backward (gradients of q, k, v): one warm-up, then ``--repeats``
calls, median / min / max. Peak memory of one forward+backward per case is measured in a fresh
subprocess: the growth of the resident size over its value before the call (inputs made, warm-up done),
sampled every millisecond by a thread — every allocation of the call, freed later or not.
``uptime`` is recorded before and after.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/bench_content.py \\
        --lengths 1024,4096,16384 --threads 2 --out plugins/attnkit-sparse/benchmarks/results/bench_content_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import attnkit

B, H, D = 1, 8, 64


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def make(name: str, L: int, args: argparse.Namespace):
    """``fn(q, k, v) -> out`` for a case name."""
    if name == "sdpa":
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if name.startswith("lsh"):
        attn = attnkit.build("lsh", bucket_size=args.bucket_size, n_hashes=args.n_hashes,
                             backend=name.split("-")[1])
        return lambda q, k, v: attn(q, q, v)                  # shared-QK: k = q
    if name == "routing":
        attn = attnkit.build("routing", num_clusters=max(1, L // args.routing_window), num_heads=H, head_dim=D,
                             backend="numba").eval()
        return lambda q, k, v: attn(q, k, v)
    if name == "sinkhorn":
        attn = attnkit.build("sinkhorn", block_size=args.block_size, num_heads=H, head_dim=D,
                             backend="numba").eval()
        return lambda q, k, v: attn(q, k, v)
    raise ValueError(name)


def inputs(L: int, grad: bool):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for _ in range(3)]


def run_once(fn, L: int, backward: bool) -> float:
    q, k, v = inputs(L, backward)
    t = time.perf_counter()
    if backward:
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    else:
        with torch.no_grad():
            fn(q, k, v)
    return time.perf_counter() - t


def timing(name: str, L: int, backward: bool, args: argparse.Namespace) -> dict[str, Any]:
    fn = make(name, L, args)
    run_once(fn, L, backward)                                  # warm-up (numba cache, plans)
    reps = args.repeats if L <= 4096 else max(1, args.repeats_long)
    ts = [run_once(fn, L, backward) for _ in range(reps)]
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "repeats": reps}


def _rss_kib() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() // 1024


def peak_child(name: str, L: int, args: argparse.Namespace) -> None:
    """Resident-size growth during one forward+backward, sampled every millisecond by a thread (the
    process's high-water mark ``ru_maxrss`` would also count the imports and the warm-up)."""
    import gc
    import threading

    torch.set_num_threads(args.threads)
    fn = make(name, L, args)
    small = [t.detach()[:, :, :128].contiguous().requires_grad_() for t in inputs(L, False)]
    out = fn(*small)
    out.backward(torch.ones_like(out))                         # imports, numba caches, autograd
    q, k, v = inputs(L, True)
    del out, small
    gc.collect()
    base = _rss_kib()
    top = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            top[0] = max(top[0], _rss_kib())
            time.sleep(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    done.set()
    th.join()
    top[0] = max(top[0], _rss_kib())
    print(json.dumps({"peak_mib": (top[0] - base) / 1024, "rss_before_mib": base / 1024}))


def peak(name: str, L: int, args: argparse.Namespace) -> float | None:
    cmd = [sys.executable, __file__, "--peak-child", f"{name}:{L}", "--threads", str(args.threads),
           "--bucket-size", str(args.bucket_size), "--n-hashes", str(args.n_hashes),
           "--routing-window", str(args.routing_window), "--block-size", str(args.block_size)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])["peak_mib"]
    except (IndexError, ValueError, KeyError):
        print(r.stderr[-2000:], file=sys.stderr)
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--cases", default="sdpa,lsh-numba,lsh-torch,routing,sinkhorn")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--repeats-long", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dense-max", type=int, default=16384)
    ap.add_argument("--bucket-size", type=int, default=64)
    ap.add_argument("--n-hashes", type=int, default=4)
    ap.add_argument("--routing-window", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-peak", action="store_true")
    ap.add_argument("--only-peak", action="store_true", help="peak memory only (no timings)")
    ap.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.peak_child:
        name, L = args.peak_child.split(":")
        peak_child(name, int(L), args)
        return 0
    torch.set_num_threads(args.threads)
    meta = {"machine": _cpu_model(), "cores": len(__import__("os").sched_getaffinity(0)), "torch": torch.__version__,
            "threads": args.threads, "B": B, "H": H, "D": D, "dtype": "float32", "argv": sys.argv,
            "uptime_before": _uptime()}
    print(meta, flush=True)
    rows = []
    for L in [int(x) for x in args.lengths.split(",")]:
        for name in args.cases.split(","):
            if name == "sdpa" and L > args.dense_max:
                continue
            row: dict[str, Any] = {"L": L, "case": name}
            row["forward"] = {"median_s": float("nan")} if args.only_peak else timing(name, L, False, args)
            if not args.no_backward and not args.only_peak:
                row["forward_backward"] = timing(name, L, True, args)
            if not args.no_peak:
                row["peak_fwd_bwd_mib"] = peak(name, L, args)
            rows.append(row)
            fb = row.get("forward_backward", {}).get("median_s", float("nan"))
            print(f"L={L:6d} {name:10s} fwd {row['forward']['median_s']:8.3f} s  fwd+bwd {fb:8.3f} s  "
                  f"peak {row.get('peak_fwd_bwd_mib')} MiB", flush=True)
    meta["uptime_after"] = _uptime()
    print(meta["uptime_after"])
    sd = {r["L"]: r for r in rows if r["case"] == "sdpa"}
    print("\n| L | case | fwd median s | vs SDPA | fwd+bwd median s | vs SDPA | peak fwd+bwd MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        s = sd.get(r["L"])
        f = r["forward"]["median_s"]
        fb = r.get("forward_backward", {}).get("median_s")
        rf = f"{s['forward']['median_s'] / f:.2f}x" if s else "—"
        rfb = f"{s['forward_backward']['median_s'] / fb:.2f}x" if s and fb and "forward_backward" in s else "—"
        pk = r.get("peak_fwd_bwd_mib")
        print(f"| {r['L']} | {r['case']} | {f:.3f} | {rf} | {fb if fb is None else f'{fb:.3f}'} | {rfb} | "
              f"{'—' if pk is None else f'{pk:.0f}'} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
