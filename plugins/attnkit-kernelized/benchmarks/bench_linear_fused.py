"""A/B of ``linear``'s causal forward without autograd on CPU: the fused numba kernel (linear/numba_fused.py)
against the unfused numba path (features by linear/numba_elu.py, then the product kernel), in one process.

Rounds alternate the two (order flipped every round) after one warm-up call each; every round records wall
time, this process's CPU time (user + system) and its minor page faults. The float32 matmul rate (median of
1024^3 products at torch's thread count) is measured before and after, and the useful FLOPs of a forward,
``4·B·H·L·D·E``, are reported as a fraction of it. Optionally SDPA causal in the same run.

The speed of this VM drifts by up to ~30% over seconds to minutes (host load: the same process measured
28-39 ms for one kernel call in consecutive minutes, session 28), which moves a fraction taken from a rate
measured before and after the rounds. So every round also measures the rate right before its calls (median
of 5 products, ``rate_round``) and reports the fraction of that paired rate; the median of those per-round
fractions is the figure that compares like with like.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-kernelized/benchmarks/bench_linear_fused.py \\
        --lengths 8192 16384 --rounds 11 [--sdpa] [--threads 1] [--output out.json]

Nothing here is a test: timings are figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch


def matmul_rate(n: int = 1024, reps: int = 20) -> float:
    """float32 GEMM rate (FLOP/s): the median of ``reps`` ``n^3`` products after one warm-up."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--sdpa", action="store_true", help="also time SDPA causal (3 rounds)")
    p.add_argument("--output", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import attnkit
    from attnkit_kernelized.linear.module import LinearAttention

    fused = LinearAttention._fused_causal
    trained = LinearAttention._trained_causal

    def unfused(self, *a, **kw):
        return None

    B, H, D = 1, args.heads, args.head_dim
    lin = attnkit.build("linear", num_heads=H, head_dim=D, backend="numba")
    rate0 = matmul_rate()
    results = []
    for L in args.lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
        rec: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": [], "faults": [], "rate_round": []}
                                                  for m in ("fused", "unfused")}
        # the unfused side runs the map and the product as two operators: the one-operator form that a call with no
        # fused no-grad kernel takes next (linear/numba_train.py, since session 66) is off for the rounds
        LinearAttention._trained_causal = unfused
        with torch.no_grad():
            for m in rec:
                LinearAttention._fused_causal = fused if m == "fused" else unfused
                lin(q, k, v, causal=True)
            for r in range(args.rounds):
                for m in (("fused", "unfused") if r % 2 == 0 else ("unfused", "fused")):
                    LinearAttention._fused_causal = fused if m == "fused" else unfused
                    rec[m]["rate_round"].append(matmul_rate(reps=5))
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    c0 = os.times()
                    t0 = time.perf_counter()
                    out = lin(q, k, v, causal=True)
                    w = time.perf_counter() - t0
                    c1 = os.times()
                    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    del out
                    rec[m]["wall"].append(w)
                    rec[m]["cpu"].append((c1.user + c1.system) - (c0.user + c0.system))
                    rec[m]["faults"].append(f1 - f0)
            LinearAttention._fused_causal = fused
            LinearAttention._trained_causal = trained
            sdpa = []
            if args.sdpa:
                for _ in range(3):
                    t0 = time.perf_counter()
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                    sdpa.append(time.perf_counter() - t0)
        results.append({"L": L, "rounds": rec, "sdpa": sdpa})
    rate1 = matmul_rate()
    rate = (rate0 + rate1) / 2
    print(f"threads {torch.get_num_threads()}; float32 matmul rate {rate0 / 1e9:.1f} before, {rate1 / 1e9:.1f} after "
          f"(GFLOP/s)")
    for res in results:
        L = res["L"]
        flops = 4 * B * H * L * D * D
        for m, d in res["rounds"].items():
            med = statistics.median(d["wall"])
            d["median_wall"] = med
            d["fraction_of_matmul_rate"] = flops / med / rate
            paired = sorted(flops / w / rr for w, rr in zip(d["wall"], d["rate_round"], strict=True))
            d["fraction_of_paired_rate"] = statistics.median(paired)
            print(f"L={L} {m}: median of the per-round fractions of the rate measured just before each call "
                  f"{100 * d['fraction_of_paired_rate']:.1f}% (rounds {100 * paired[0]:.1f}-{100 * paired[-1]:.1f}%; "
                  f"paired rates {min(d['rate_round']) / 1e9:.0f}-{max(d['rate_round']) / 1e9:.0f} GFLOP/s)")
            print(f"L={L} {m}: median {med * 1e3:.2f} ms ({100 * flops / med / rate:.1f}% of the rate), "
                  f"best {min(d['wall']) * 1e3:.2f} ms ({100 * flops / min(d['wall']) / rate:.1f}%); "
                  f"cpu median {statistics.median(d['cpu']) * 1e3:.0f} ms; rounds (ms) "
                  + " ".join(f"{x * 1e3:.1f}" for x in d["wall"]) + "; minor faults " + " ".join(map(str, d["faults"])))
        if res["sdpa"]:
            s = statistics.median(res["sdpa"])
            a, b = res["rounds"]["fused"]["median_wall"], res["rounds"]["unfused"]["median_wall"]
            print(f"L={L} sdpa causal: median {s * 1e3:.1f} ms; fused {s / a:.1f}x, unfused {s / b:.1f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"matmul_rate": [rate0, rate1], "threads": torch.get_num_threads(), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
