"""Causal 256-key window: the engine's numba forward against compiled FlexAttention on CPU, interleaved.

float32, B=1, H=8, D=64 (issue 10's case). For each L: FlexAttention's own
``create_block_mask`` (compiled) for the same mask and a compiled, warmed
``flex_attention``; the engine's plan and numba kernels (``attend(...,
backend="numba")``, what ``attnkit.build("local", window=256)`` runs on CPU).
Then ``--rounds`` rounds of (flex, numba) calls, alternating, so load from
other jobs on a shared machine falls on both alike: medians, minima and the
ratio of medians. With ``--backward``, numba forward+backward against SDPA
causal forward+backward, alternating, ``--sdpa-rounds`` rounds (and SDPA
causal forward against numba forward). The float32 matmul rate (2048³, median of 3) is measured at
the start and the end of the run; "% matmul" counts useful FLOPs only
(``4·H·pairs·D``) against the mean of the two. ``uptime`` is printed before
and after.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/bench_local_vs_flex.py \\
        --lengths 16384 --rounds 15 --threads 2 --out plugins/attnkit-sparse/benchmarks/results/local_vs_flex.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from attnkit import masks  # noqa: E402
from attnkit_sparse.engine import attend, plan  # noqa: E402

B, H, D, W = 1, 8, 64, 256


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def matmul_rate() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    return 2 * 2048 ** 3 / statistics.median(ts)


def alternate(fns: dict, rounds: int) -> dict:
    """``rounds`` rounds of one call each, the order flipped every round: seconds per call by name."""
    ts: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(rounds):
        for name, fn in (items if r % 2 == 0 else items[::-1]):
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "all_s": t}
            for name, t in ts.items()}


def fwd_bwd(fn, leaves):
    def run() -> None:
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        for t in leaves:
            t.grad = None
    return run


def backward_rows(L: int, rounds: int, m) -> dict:
    g = torch.Generator().manual_seed(L)
    leaves = [torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3)]

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def numba(q, k, v):
        return attend(q, k, v, m, backend="numba", block_size=64)

    fns = {"sdpa_fwd_bwd": fwd_bwd(sdpa, leaves), "numba_fwd_bwd": fwd_bwd(numba, leaves)}
    for fn in fns.values():
        fn()
    res = alternate(fns, rounds)
    with torch.no_grad():
        fwd = {"sdpa_fwd": lambda: sdpa(*leaves), "numba_fwd": lambda: numba(*leaves)}
        res.update(alternate(fwd, rounds))
    return res


def one_length(L: int, rounds: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < W)

    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, None, None, L, L, device="cpu", _compile=True)
    bm_s = time.perf_counter() - t0
    compiled = torch.compile(flex_attention, dynamic=False)
    m = masks.causal() & masks.sliding_window(W - 1)
    t0 = time.perf_counter()
    plan(m, B, H, L, L, block_size=64)
    plan_s = time.perf_counter() - t0

    def flex() -> torch.Tensor:
        return compiled(q, k, v, block_mask=bm)

    def numba() -> torch.Tensor:
        return attend(q, k, v, m, backend="numba", block_size=64)

    with torch.no_grad():
        t0 = time.perf_counter()
        a = flex()
        flex_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        b = numba()
        numba_first = time.perf_counter() - t0
        diff = float((a - b).abs().max())
        for fn in (flex, numba, flex, numba):  # warm
            fn()
        ts: dict[str, list[float]] = {"flex": [], "numba": []}
        for r in range(rounds):
            order = (("flex", flex), ("numba", numba)) if r % 2 == 0 else (("numba", numba), ("flex", flex))
            for name, fn in order:
                t0 = time.perf_counter()
                fn()
                ts[name].append(time.perf_counter() - t0)
    pairs = H * sum(min(i + 1, W) for i in range(L))
    row = {"L": L, "block_mask_s": bm_s, "flex_first_s": flex_first, "plan_s": plan_s, "numba_first_s": numba_first,
           "max_abs_diff": diff, "useful_flops": 4 * pairs * D}
    for name, t in ts.items():
        row[name] = {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "all_s": t}
    row["flex_over_numba"] = row["flex"]["median_s"] / row["numba"]["median_s"]
    row["flex_over_numba_min"] = row["flex"]["min_s"] / row["numba"]["min_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="16384")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backward", action="store_true", help="also numba fwd+bwd against SDPA causal (fwd, fwd+bwd)")
    ap.add_argument("--sdpa-rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    up0 = uptime()
    print("before:", up0, flush=True)
    rate0 = matmul_rate()
    print(f"float32 matmul {rate0 / 1e9:.1f} GFLOP/s ({args.threads} threads)", flush=True)
    rows = []
    for L in (int(x) for x in args.lengths.split(",")):
        row = one_length(L, args.rounds)
        rows.append(row)
        f, n = row["flex"], row["numba"]
        print(f"L={L:6d} flex {f['median_s'] * 1e3:7.1f} ms (min {f['min_s'] * 1e3:6.1f})  numba "
              f"{n['median_s'] * 1e3:7.1f} ms (min {n['min_s'] * 1e3:6.1f})  flex/numba {row['flex_over_numba']:.2f}x "
              f"(min/min {row['flex_over_numba_min']:.2f}x)  numba {row['useful_flops'] / n['median_s'] / 1e9:.1f} "
              f"useful GFLOP/s; block mask {row['block_mask_s']:.2f} s, flex first call {row['flex_first_s']:.2f} s, "
              f"plan {row['plan_s'] * 1e3:.1f} ms, max |diff| {row['max_abs_diff']:.1e}", flush=True)
        if args.backward:
            row["vs_sdpa"] = backward_rows(L, args.sdpa_rounds, masks.causal() & masks.sliding_window(W - 1))
            b = row["vs_sdpa"]
            med = {name: b[name]["median_s"] for name in b}
            print(f"    SDPA causal fwd {med['sdpa_fwd'] * 1e3:8.1f} ms, numba fwd {med['numba_fwd'] * 1e3:6.1f} ms "
                  f"({med['sdpa_fwd'] / med['numba_fwd']:.1f}x); SDPA fwd+bwd {med['sdpa_fwd_bwd'] * 1e3:8.1f} ms, "
                  f"numba fwd+bwd {med['numba_fwd_bwd'] * 1e3:6.1f} ms "
                  f"({med['sdpa_fwd_bwd'] / med['numba_fwd_bwd']:.1f}x)", flush=True)
    rate1 = matmul_rate()
    up1 = uptime()
    print(f"float32 matmul at the end {rate1 / 1e9:.1f} GFLOP/s", flush=True)
    print("after:", up1, flush=True)
    rate = (rate0 + rate1) / 2
    for row in rows:
        row["numba_pct_matmul"] = 100 * row["useful_flops"] / row["numba"]["median_s"] / rate
        row["flex_pct_matmul"] = 100 * row["useful_flops"] / row["flex"]["median_s"] / rate
        print(f"L={row['L']}: numba {row['numba_pct_matmul']:.0f}% of matmul, flex {row['flex_pct_matmul']:.0f}%")
    result = {"command": " ".join(sys.argv), "torch": torch.__version__, "threads": args.threads,
              "uptime_before": up0, "uptime_after": up1, "matmul_flops_per_s": [rate0, rate1], "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
