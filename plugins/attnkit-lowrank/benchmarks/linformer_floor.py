"""Linformer's product floor against lucidrains' ``linformer``: can any implementation be 2x faster?

Issue 12 asks ``linformer`` (proj_len 256) to run at least 2x faster than lucidrains' package at L = 16,384,
forward and forward + backward. Every Linformer, whatever its code, computes the same matrix products:

* forward (4): ``K' = Eᵀ K`` and ``V' = Fᵀ V`` (E, F shared by the heads: one ``(k, L) @ (L, H·D)`` product
  each), the scores ``Q K'ᵀ`` and the output ``P V'`` (per head ``(L, D) @ (D, k)`` and ``(L, k) @ (k, D)``);
* backward (8): ``dV' = Pᵀ dO``, ``dP = dO V'ᵀ``, ``dQ = dS K'``, ``dK' = dSᵀ Q``, ``dK = E dK'``,
  ``dV = F dV'``, and the parameters' ``dE = K dK'ᵀ``, ``dF = V dV'ᵀ``.

This script times exactly those products with torch's own matmul (preallocated outputs, ``out=``: no
allocation, no softmax, no autograd) and, in the same process and alternated with them, the public layer's
attention alone and attnkit's (as ``bench_external.py`` times them: the public layer with its projections
replaced by fixed tensors). If the products alone take more than half the public time, no implementation
built on this machine's matmul reaches 2x: softmax, its backward and the memory traffic only add to them.

Runs in the benchmark venv that has ``linformer`` (never a dependency)::

    PYTHONPATH=packages/attnkit/src:plugins/attnkit-lowrank/src flock /tmp/attnkit-bench.lock \\
        /work/venvs/bench-s12c/bin/python plugins/attnkit-lowrank/benchmarks/linformer_floor.py \\
        --length 16384 --rounds 5 --out plugins/attnkit-lowrank/benchmarks/results/linformer_floor.json

Nothing here is a test: the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

H, D, DIM, K = 8, 64, 512, 256


def products(L: int):
    """(forward products, backward products): callables running the 4 and 8 products on fixed tensors."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    E, Fp = r(L, K), r(L, K)
    Kx, Vx, Q, dO = r(L, H * D), r(L, H * D), r(H, L, D), r(H, L, D)
    P, dS = r(H, L, K), r(H, L, K)
    Kp, Vp = torch.empty(K, H * D), torch.empty(K, H * D)
    Kh = Kp.view(K, H, D).transpose(0, 1)            # (H, k, D) views of K', V' as the heads use them
    Vh = Vp.view(K, H, D).transpose(0, 1)
    S_, O_ = torch.empty(H, L, K), torch.empty(H, L, D)
    dVp, dKp = torch.empty(H, K, D), torch.empty(H, K, D)
    dP, dQ = torch.empty(H, L, K), torch.empty(H, L, D)
    dK, dV = torch.empty(L, H * D), torch.empty(L, H * D)
    dE, dF = torch.empty(L, K), torch.empty(L, K)
    dKp2 = dKp.transpose(0, 1).reshape(K, H * D)      # the heads' dK' side by side, as Eᵀ's gradient needs them
    dVp2 = dVp.transpose(0, 1).reshape(K, H * D)

    def fwd():
        torch.matmul(E.T, Kx, out=Kp)                 # K' = Eᵀ K   (k, L) @ (L, H·D)
        torch.matmul(Fp.T, Vx, out=Vp)                # V' = Fᵀ V
        torch.matmul(Q, Kh.transpose(1, 2), out=S_)   # Q K'ᵀ      (H, L, D) @ (H, D, k)
        torch.matmul(P, Vh, out=O_)                   # P V'       (H, L, k) @ (H, k, D)

    def bwd():
        torch.matmul(P.transpose(1, 2), dO, out=dVp)  # dV' = Pᵀ dO   (H, k, L) @ (H, L, D)
        torch.matmul(dO, Vh.transpose(1, 2), out=dP)  # dP = dO V'ᵀ
        torch.matmul(dS, Kh, out=dQ)                  # dQ = dS K'
        torch.matmul(dS.transpose(1, 2), Q, out=dKp)  # dK' = dSᵀ Q
        torch.matmul(E, dKp2, out=dK)                 # dK = E dK'    (L, k) @ (k, H·D)
        torch.matmul(Fp, dVp2, out=dV)                # dV = F dV'
        torch.matmul(Kx, dKp2.T, out=dE)              # dE = K dK'ᵀ   (L, H·D) @ (H·D, k)
        torch.matmul(Vx, dVp2.T, out=dF)              # dF = V dV'ᵀ

    return fwd, bwd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_external import attention_only, one_pass, pair

    L = args.length
    up = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    res = {"command": " ".join(sys.argv), "threads": args.threads, "torch": torch.__version__, "L": L,
           "uptime_before": up()}
    fwd, bwd = products(L)
    flops_fwd, flops_bwd = 4 * 2 * L * K * H * D, 8 * 2 * L * K * H * D
    calls = {"products fwd": fwd, "products fwd+bwd": lambda: (fwd(), bwd())}
    for mode in ("fwd", "fwd+bwd"):
        grad = mode == "fwd+bwd"
        pub, ours = pair("linformer", L)
        pub_call, ours_call, inputs = attention_only("linformer", pub, ours, L, grad)
        for side, call in (("public", pub_call), ("attnkit", ours_call)):
            calls[f"{side} {mode}"] = one_pass(call, grad, inputs)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for r in range(args.rounds):
        for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    res["median_s"] = med
    res["times_s"] = times
    res["rates_gflops"] = {"products fwd": flops_fwd / med["products fwd"] / 1e9,
                           "products fwd+bwd": (flops_fwd + flops_bwd) / med["products fwd+bwd"] / 1e9}
    for mode in ("fwd", "fwd+bwd"):
        floor, pub, ours = med[f"products {mode}"], med[f"public {mode}"], med[f"attnkit {mode}"]
        res[mode] = {"floor_over_public": floor / pub, "speedup": pub / ours, "ceiling_speedup": pub / floor}
        print(f"L={L} {mode:8s} products alone {floor * 1e3:7.1f} ms "
              f"({res['rates_gflops'][f'products {mode}']:.1f} GFLOP/s)  public {pub * 1e3:7.1f} ms  "
              f"attnkit {ours * 1e3:7.1f} ms ({pub / ours:.2f}x)  ceiling: public / products = {pub / floor:.2f}x",
              flush=True)
    res["uptime_after"] = up()
    print(res["uptime_before"], "->", res["uptime_after"])
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
