"""CPU benchmark of the low-rank attentions against SDPA in the same run.

float32, B=1, H=8, D=E=64, non-causal self-attention, L from 1K up:

* ``time``: median forward and forward+backward seconds of ``nystrom``
  (64 landmarks, 6 pseudo-inverse iterations), ``linformer`` (proj_len 256,
  max_length = the longest L of the run), ``soft`` in the paper's form (k is q;
  stride 64, conv bottleneck, 20 Newton iterations; and ``soft-m128``: the
  stride L/128, i.e. a fixed 128 bottleneck tokens) and SDPA
  (``torch.nn.functional.scaled_dot_product_attention``; skipped above
  ``--sdpa-max``), with the achieved GFLOP/s of each forward from its
  matrix-product FLOP count next to the float32 matmul rate measured in the
  same run (a 2048^3 product);
* ``memory``: peak resident memory of the first forward+backward above the
  process's resident memory just before it (inputs and module built), one fresh
  process per cell (Linux).

Raw JSON goes to ``--out``. Run it alone, e.g.::

    flock /tmp/attnkit-bench.lock python benchmarks/bench_lowrank.py --out benchmarks/results/bench_lowrank_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnkit

H, D = 8, 64
NYSTROM_M, LINFORMER_K, SOFT_STRIDE, PINV_ITERS, NEWTON_ITERS = 64, 256, 64, 6, 20
IMPLS = ("sdpa", "nystrom", "linformer", "soft", "soft-m128")
#: the other mechanisms at their papers' defaults (``--impls``): informer c=5, memory-compressed stride 3 (conv),
#: clustered / improved-clustered C=100 (top-k 32), isab 32 inducing points
OTHERS = ("informer", "memory-compressed", "clustered", "improved-clustered", "isab")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


#: the clock of ``timed``: wall time (``perf_counter``), or with ``--clock cpu`` this process's CPU time
#: (``process_time``): on shared cores a one-thread run's CPU time leaves out the time it sat descheduled
CLOCK = time.perf_counter


def timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    fn()                                      # warm-up
    ts = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}


def matmul_rate() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048 ** 3 / timed(lambda: a @ b, 5)["median_s"]


def matmul_rate_near() -> float:
    """float32 FLOP/s of a 1024^3 matmul (median of 3), measured right before a cell: the load moves."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024 ** 3 / timed(lambda: a @ b, 3)["median_s"]


def soft_stride(name: str, L: int) -> int:
    return SOFT_STRIDE if name == "soft" else max(1, L // 128)


def build(name: str, L: int, max_length: int) -> torch.nn.Module | None:
    torch.manual_seed(0)
    if name == "sdpa":
        return None
    if name == "nystrom":
        return attnkit.build("nystrom", num_landmarks=NYSTROM_M, pinv_iterations=PINV_ITERS)
    if name == "linformer":
        return attnkit.build("linformer", proj_len=LINFORMER_K, max_length=max_length)
    if name in OTHERS:
        return attnkit.build(name, head_dim=D) if name in ("memory-compressed", "isab") else attnkit.build(name)
    return attnkit.build("soft", head_dim=D, stride=soft_stride(name, L), pinv_iterations=NEWTON_ITERS)


def flops(name: str, L: int) -> float:
    """Matrix-product FLOPs of one forward (all heads); softmax/exp and elementwise work not counted."""
    S = E = L
    E = D
    if name == "sdpa":
        return H * 4 * L * S * D
    if name in OTHERS:
        return float("nan")                                     # not modelled
    if name == "nystrom":
        m = NYSTROM_M
        per = 2 * m * (L * D + S * D + S * E + L * E) + 2 * m * m * (D + E) + PINV_ITERS * 4 * 2 * m ** 3
        return H * per
    if name == "linformer":
        k = LINFORMER_K
        return H * 2 * k * (S * D + S * E + L * D + L * E)
    s = soft_stride(name, L)
    m = -(-L // s)
    # k is q: P computed once. On CPU the Newton iterate comes from one float64 eigendecomposition
    # (newton_pinv_sym), not 2·NEWTON_ITERS m^3 products: it is not counted (like exp); before that change the
    # count included NEWTON_ITERS·4·m^3 (10.7 of ~25 GFLOP at 16K)
    per = 2 * S * D * D + 2 * m * m * D + 2 * m * S * D + 2 * m * m * E + 2 * m * S * E + 2 * L * m * E
    return H * per


def runner(name: str, L: int, backward: bool, max_length: int) -> Callable[[], None]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_(backward) for _ in range(3))
    attn = build(name, L, max_length)
    if attn is not None:
        attn.eval()
    if name.startswith("soft"):
        k = q                                   # the paper's shared projection: Q = K

    def fwd() -> torch.Tensor:
        if attn is None:
            return F.scaled_dot_product_attention(q, k, v)
        return attn(q, k, v)

    def run() -> None:
        if backward:
            fwd().sum().backward()
            for t in (q, v) + (() if k is q else (k,)):
                t.grad = None
            if attn is not None:
                attn.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                fwd()
    return run


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def peak_child(name: str, L: int, max_length: int) -> None:
    """Peak resident memory of the first forward+backward above the process just before it (inputs and module
    built). The first call, not a second one: memory freed by a warm-up stays resident (the allocator keeps it),
    so a second call would mostly reuse it and understate the peak."""
    run = runner(name, L, True, max_length)
    Path("/proc/self/clear_refs").write_text("5")   # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    run()
    print(json.dumps({"peak_mib": (_status_kib("VmHWM") - before) / 1024}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--sdpa-max", type=int, default=16384)
    p.add_argument("--soft-max", type=int, default=16384, help="longest L for soft at stride 64 (m = L/64 grows)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS + OTHERS)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-time", action="store_true", help="peak memory only")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or this process's CPU time (one thread on shared cores)")
    p.add_argument("--out", type=Path)
    p.add_argument("--peak-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak_child:
        peak_child(args.peak_child[0], int(args.peak_child[1]), int(args.peak_child[2]))
        return 0
    max_length = max(args.lengths)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "cpu": _cpu_model(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "uptime_before": _uptime(), "clock": args.clock,
        "settings": {"B": 1, "H": H, "D": D, "dtype": "float32", "causal": False, "nystrom_landmarks": NYSTROM_M,
                     "nystrom_pinv_iterations": PINV_ITERS, "linformer_proj_len": LINFORMER_K,
                     "linformer_max_length": max_length, "soft_stride": SOFT_STRIDE,
                     "soft_m128_stride": "L // 128", "soft_newton_iterations": NEWTON_ITERS,
                     "soft_k_is_q": True},
    }
    print(result["uptime_before"], flush=True)
    rate = matmul_rate()
    result["matmul_gflops"] = rate / 1e9
    print(f"float32 matmul 2048^3: {rate / 1e9:.1f} GFLOP/s", flush=True)
    rows = []
    for L in ([] if args.no_time else args.lengths):
        for mode in ("fwd", "fwd+bwd"):
            base = None
            for name in args.impls:
                if (name == "sdpa" and L > args.sdpa_max) or (name == "soft" and L > args.soft_max):
                    continue
                near = matmul_rate_near() if mode == "fwd" else None
                t = timed(runner(name, L, mode == "fwd+bwd", max_length), args.repeats)
                row = {"L": L, "mode": mode, "impl": name, **t}
                if name == "sdpa":
                    base = t["median_s"]
                elif base is not None:
                    row["speedup_vs_sdpa"] = base / t["median_s"]
                if mode == "fwd" and name not in OTHERS:
                    row["gflops"] = flops(name, L) / t["median_s"] / 1e9
                    row["fraction_of_matmul_rate"] = row["gflops"] * 1e9 / rate
                    row["matmul_gflops_before"] = near / 1e9
                    row["fraction_of_matmul_rate_before"] = row["gflops"] * 1e9 / near
                rows.append(row)
                extra = f"  {row['speedup_vs_sdpa']:7.1f}x sdpa" if "speedup_vs_sdpa" in row else ""
                extra += (f"  {row['gflops']:6.1f} GFLOP/s ({row['fraction_of_matmul_rate_before']:.0%} of "
                          f"matmul {row['matmul_gflops_before']:.0f} just before)") if "gflops" in row else ""
                print(f"L={L:6d} {mode:8s} {name:10s} {t['median_s'] * 1e3:10.1f} ms{extra}", flush=True)
    result["time"] = rows
    mem = []
    if not args.no_memory:
        for L in args.lengths:
            for name in args.impls:
                if (name == "sdpa" and L > args.sdpa_max) or (name == "soft" and L > args.soft_max):
                    continue
                res = subprocess.run([sys.executable, __file__, "--peak-child", name, str(L), str(max_length)],
                                     capture_output=True, text=True, check=False)
                if res.returncode:
                    mem.append({"L": L, "impl": name, "error": res.stderr.strip().splitlines()[-1:]})
                    continue
                peak = json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]
                mem.append({"L": L, "impl": name, "peak_mib": peak})
                print(f"L={L:6d} {name:10s} peak {peak:9.1f} MiB (fwd+bwd)", flush=True)
    result["memory"] = mem
    result["uptime_after"] = _uptime()
    print(result["uptime_after"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
