"""adaptive-span on its numba CPU kernels: does the cost follow the span, and how far from the 20x goal?

float32, B = 1, H = 8, D = 64, causal, L = 2,048 / 4,096 / 8,192 (``--lengths``). In one run, per length:

* ``adaptive-span`` with every head's span set to 64 (ramp 32, max_span = L, backend ``numba``, the CPU
  default);
* the same module with span L (every key reachable: the kernels do the whole causal triangle);
* SDPA causal (``scaled_dot_product_attention(is_causal=True)``);
* optionally (``--torch-band``) the torch band path at span 64, block 32 (the previous default path).

Forward (no autograd) and forward+backward (gradients of q, k, v and of the spans), the median of
``--repeats`` timings after one warm-up. Useful FLOPs: ``4·D`` per (query, key) pair with a nonzero weight
(``QKᵀ`` and ``PV``) in the forward, 3.5x that for forward+backward (the backward's five products); the
machine's float32 matmul rate is measured in the same run (2,048³, the same threads) for the
"fraction of matmul rate" figure. Raw JSON in ``benchmarks/results/``; timings are never asserted in tests.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-adaptive/benchmarks/bench_span_numba.py [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up (and numba compile / cache load)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def pairs(L: int, z: float, ramp: float) -> int:
    """(query, key) pairs with a nonzero soft-mask weight: distance x < z + R, x <= i."""
    reach = math.ceil(z + ramp)  # distances 0 .. reach - 1
    return sum(min(i + 1, reach) for i in range(L))


def matmul_rate(repeats: int) -> float:
    """The float32 matmul rate (2,048³; the fastest of ``repeats``: the machine's rate when it is not shared)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    t = min(timed(lambda: a @ b, repeats))
    return 2 * 2048 ** 3 / t


def run_case(rows: list, label: str, L: int, make, params, flops: int, rate: float, repeats: int) -> dict:
    """Time ``make()`` forward (no autograd) and forward+backward (``params``' gradients); one row."""
    def fwd():
        with torch.no_grad():
            make()

    def fwd_bwd():
        for t in params:
            t.grad = None
        make().sum().backward()

    tf = timed(fwd, repeats)
    tfb = timed(fwd_bwd, repeats)
    row = {"case": label, "L": L, "fwd_s": statistics.median(tf), "fwd_bwd_s": statistics.median(tfb),
           "fwd_all_s": tf, "fwd_bwd_all_s": tfb, "useful_fwd_gflop": flops / 1e9}
    row["fwd_frac_matmul"] = flops / row["fwd_s"] / rate
    row["fwd_bwd_frac_matmul"] = 3.5 * flops / row["fwd_bwd_s"] / rate
    rows.append(row)
    print(f"L={L:6d} {label:45s} fwd {row['fwd_s'] * 1e3:9.1f} ms  fwd+bwd {row['fwd_bwd_s'] * 1e3:9.1f} ms"
          f"  useful {flops / 1e9:6.2f} GFLOP fwd, {row['fwd_frac_matmul']:.0%} / "
          f"{row['fwd_bwd_frac_matmul']:.0%} of matmul rate", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--span", type=float, default=64.0)
    ap.add_argument("--ramp", type=float, default=32.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torch-band", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch (and so numba) threads; default torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, D = 1, args.heads, 64
    meta = {"command": " ".join(sys.argv), "uptime_before": uptime(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
            "B": B, "H": H, "D": D, "dtype": "float32", "span": args.span, "ramp": args.ramp,
            "repeats": args.repeats}
    print(meta["uptime_before"], flush=True)
    rate = matmul_rate(5)
    meta["matmul_gflops"] = rate / 1e9
    print(f"float32 matmul 2048^3: {rate / 1e9:.1f} GFLOP/s", flush=True)
    rows = []
    for L in args.lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3))
        cases = [(f"adaptive-span span={args.span:g} numba", args.span, "numba", 64),
                 ("adaptive-span span=L numba", float(L), "numba", 64)]
        if args.torch_band:
            cases.append((f"adaptive-span span={args.span:g} torch band, block 32", args.span, "torch", 32))
        sdpa = run_case(rows, "SDPA causal", L, lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True), (q, k, v), 4 * D * B * H * L * (L + 1) // 2, rate, args.repeats)
        for label, z, backend, block in cases:
            attn = attnkit.build("adaptive-span", num_heads=H, max_span=L, ramp=args.ramp, init_span=z,
                                 block_size=block, backend=backend)
            row = run_case(rows, label, L, lambda a=attn, q=q, k=k, v=v: a(q, k, v, causal=True),
                           (q, k, v, attn.span_fraction), 4 * D * B * H * pairs(L, z, args.ramp), rate, args.repeats)
            row["vs_sdpa_fwd"] = sdpa["fwd_s"] / row["fwd_s"]
            row["vs_sdpa_fwd_bwd"] = sdpa["fwd_bwd_s"] / row["fwd_bwd_s"]
            print(f"    vs SDPA causal: fwd {row['vs_sdpa_fwd']:.1f}x, fwd+bwd {row['vs_sdpa_fwd_bwd']:.1f}x "
                  "(goal at span 64: 20x)", flush=True)
        full = next(r for r in rows if r["L"] == L and r["case"] == "adaptive-span span=L numba")
        for r in rows:
            if r["L"] == L and r["case"].startswith("adaptive-span"):
                r["vs_span_L_fwd"] = full["fwd_s"] / r["fwd_s"]
                r["vs_span_L_fwd_bwd"] = full["fwd_bwd_s"] / r["fwd_bwd_s"]
    meta["uptime_after"] = uptime()
    print(meta["uptime_after"], flush=True)
    out = Path(__file__).parent / "results" / f"bench_span_numba-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
