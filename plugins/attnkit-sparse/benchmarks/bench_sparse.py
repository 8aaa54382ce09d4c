"""CPU benchmark of the block-sparse engine: a causal local window against SDPA and FlexAttention.

Case (issue 10): float32, B=1, H=8, D=64, causal sliding window of ``--window``
keys (256: each query sees itself and the 255 before it), L in ``--lengths``.
All in one run, on this machine:

* ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` (dense causal; skipped
  above ``--dense-max`` where it would take minutes or exceed memory);
* ``flex``: PyTorch FlexAttention on CPU, compiled, warm, with its own
  ``create_block_mask`` for the same causal window (block-mask build time and
  compile time reported apart); forward only (no CPU backward in PyTorch);
* ``attnkit-torch``: the engine's block-gather path;
* ``attnkit-numba``: the engine's numba kernels, at each of ``--block-sizes``.

Forward (under ``torch.no_grad``), and with ``--backward`` forward+backward.
Each timing is one warm-up then ``--repeats`` calls: median, min and max.
Useful FLOPs count only allowed (query, key) pairs: ``4·B·H·pairs·D`` for the
forward, 3.5x that for forward+backward (FlashAttention's convention), as a
fraction of this machine's float32 matmul rate measured in the same run.
Also: the engine's plan (block index + element masks + transposed index) build
time per length, and first-call times of a fresh process (cold: numba loads its
cached compilation; warm: the second call).

    python plugins/attnkit-sparse/benchmarks/bench_sparse.py --lengths 1024,4096,16384,65536 \
        --repeats 5 --backward --threads 2 --out results/bench_sparse_cpu.json

``--out`` writes JSON (``.json``) or a markdown table (``.md``); the table is printed either way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnkit import masks
from attnkit_sparse.engine import attend, plan

B, H, D = 1, 8, 64


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """One warm-up call, then ``repeats`` timed calls: seconds (median, min, max) and the first call."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "first_s": first}


def matmul_rate(repeats: int) -> float:
    """float32 FLOP/s of a 2048 x 2048 x 2048 matmul (median)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    t = timed(lambda: a @ b, max(3, repeats))["median_s"]
    return 2 * 2048 ** 3 / t


def window_mask(window: int) -> masks.Mask:
    return masks.causal() & masks.sliding_window(window - 1)


def _inputs(L: int, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(L)
    return tuple(torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for _ in range(3))


def _fb(fn: Callable[[], torch.Tensor], qkv: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    def run() -> None:
        out = fn()
        out.backward(torch.ones_like(out))
        for t in qkv:
            t.grad = None
    return run


def _no_grad(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn()
    return run


def bench_length(L: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    w = args.window
    m = window_mask(w)
    pairs = B * H * sum(min(i + 1, w) for i in range(L))
    fwd_flops = 4 * pairs * D

    def record(name: str, mode: str, t: dict[str, float] | None, **extra: Any) -> None:
        row = {"L": L, "impl": name, "mode": mode, **extra}
        if t is not None:
            flops = fwd_flops * (3.5 if mode == "fwd+bwd" else 1.0)
            row.update(t, useful_flops_per_s=flops / t["median_s"])
        rows.append(row)
        shown = f"{t['median_s'] * 1e3:10.1f} ms" if t else "   skipped"
        print(f"  L={L:6d} {name:22s} {mode:8s}{shown}  {extra.get('note', '')}", flush=True)

    modes = ["fwd", "fwd+bwd"] if args.backward else ["fwd"]
    # ---- SDPA causal (dense)
    for mode in modes:
        if L > args.dense_max or "sdpa" in args.skip:
            record("sdpa-causal", mode, None, note=f"skipped (L > --dense-max {args.dense_max})")
            continue
        q, k, v = _inputs(L, mode == "fwd+bwd")
        fn = lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True)
        record("sdpa-causal", mode, timed(_no_grad(fn) if mode == "fwd" else _fb(fn, (q, k, v)), args.repeats))
    # ---- FlexAttention (public path: create_block_mask + compiled flex_attention), forward only
    if "flex" not in args.skip and L <= args.flex_max:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < w)

        t0 = time.perf_counter()
        try:
            # _compile=True: the block mask is built by a compiled kernel, not from an (L, L) evaluation
            # (the eager build needs L² bytes: 32 GiB at 64K); its time includes that compile
            bm = create_block_mask(mask_mod, None, None, L, L, device="cpu", _compile=True)
        except (RuntimeError, MemoryError) as exc:
            record("flex-cpu", "fwd", None, note=f"failed: create_block_mask: {str(exc).splitlines()[0][:120]}")
            bm = None
        build = time.perf_counter() - t0
        if bm is not None:
            compiled = torch.compile(flex_attention, dynamic=False)
            q, k, v = _inputs(L, False)
            fn = _no_grad(lambda: compiled(q, k, v, block_mask=bm))
            t = timed(fn, args.repeats)
            record("flex-cpu", "fwd", t, block_mask_build_s=build, compile_s=t["first_s"] - t["median_s"],
                   note=f"block mask {build:.2f} s, compile ~{t['first_s'] - t['median_s']:.1f} s")
    elif "flex" not in args.skip:
        record("flex-cpu", "fwd", None, note=f"skipped (L > --flex-max {args.flex_max})")
    # ---- attnkit: plan build, torch path, numba path
    for bs in args.block_sizes:
        t0 = time.perf_counter()
        p = plan(window_mask(w), B, H, L, L, block_size=bs)  # a fresh mask: block index + plan from scratch
        build = time.perf_counter() - t0
        rows.append({"L": L, "impl": "attnkit-plan", "block_size": bs, "build_s": build, "tiles": p.tiles,
                     "plan_bytes": p.nbytes()})
        print(f"  L={L:6d} plan (block {bs}) built in {build * 1e3:.1f} ms, {p.tiles} tiles, "
              f"{p.nbytes() / 2 ** 20:.1f} MiB", flush=True)
    for backend in ("torch", "numba"):
        if f"attnkit-{backend}" in args.skip:
            continue
        sizes = args.block_sizes if backend == "numba" else args.block_sizes[:1]
        for bs in sizes:
            for mode in modes:
                if backend == "torch" and L > args.torch_max:
                    record(f"attnkit-{backend}/{bs}", mode, None, note=f"skipped (L > --torch-max {args.torch_max})")
                    continue
                q, k, v = _inputs(L, mode == "fwd+bwd")
                fn = lambda q=q, k=k, v=v, bs=bs, backend=backend: attend(  # noqa: E731
                    q, k, v, m, backend=backend, block_size=bs)
                record(f"attnkit-{backend}/{bs}", mode,
                       timed(_no_grad(fn) if mode == "fwd" else _fb(fn, (q, k, v)), args.repeats))
    return rows


_FIRST_CALL = """
import sys, time, torch
torch.set_num_threads({threads})
t0 = time.perf_counter()
from attnkit import masks
from attnkit_sparse.engine import attend
t_import = time.perf_counter() - t0
q, k, v = (torch.randn(1, 8, {L}, 64) for _ in range(3))
m = masks.causal() & masks.sliding_window({w} - 1)
ts = []
for _ in range(3):
    t0 = time.perf_counter()
    with torch.no_grad():
        attend(q, k, v, m, backend="numba", block_size={bs})
    ts.append(time.perf_counter() - t0)
print(t_import, *ts)
"""


def first_call(L: int, args: argparse.Namespace) -> dict[str, Any]:
    """Import, first (cold: plan + numba's cached compilation), second and third call times in a fresh process."""
    code = _FIRST_CALL.format(threads=torch.get_num_threads(), L=L, w=args.window, bs=args.block_sizes[0])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    t_import, cold, warm, warm2 = map(float, out[-4:])
    print(f"  first call at L={L}: import {t_import:.2f} s, cold {cold * 1e3:.0f} ms, warm {warm * 1e3:.0f} ms, "
          f"{warm2 * 1e3:.0f} ms", flush=True)
    return {"L": L, "impl": "attnkit-numba first call", "import_s": t_import, "cold_s": cold, "warm_s": warm,
            "warm2_s": warm2}


def markdown(result: dict[str, Any]) -> str:
    rate = result["matmul_flops_per_s"]
    lines = [f"CPU: {result['cpu']}, torch threads {result['threads']}, torch {result['torch']}; float32 matmul "
             f"{rate / 1e9:.1f} GFLOP/s. Causal window {result['window']}, B={B}, H={H}, D={D}.", "",
             "| L | implementation | mode | median ms | min-max ms | useful GFLOP/s | % of matmul | x SDPA |",
             "|---|---|---|---|---|---|---|---|"]
    sdpa = {(r["L"], r["mode"]): r["median_s"] for r in result["rows"]
            if r["impl"] == "sdpa-causal" and "median_s" in r}
    for r in result["rows"]:
        if "median_s" not in r:
            continue
        base = sdpa.get((r["L"], r["mode"]))
        speed = f"{base / r['median_s']:.1f}" if base else "-"
        lines.append(f"| {r['L']} | {r['impl']} | {r['mode']} | {r['median_s'] * 1e3:.1f} | "
                     f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f} | {r['useful_flops_per_s'] / 1e9:.1f} | "
                     f"{100 * r['useful_flops_per_s'] / rate:.0f}% | {speed} |")
    extra = [r for r in result["rows"] if r["impl"] in ("flex-cpu",) and "block_mask_build_s" in r]
    for r in extra:
        lines.append(f"\nflex-cpu L={r['L']}: create_block_mask {r['block_mask_build_s']:.2f} s, "
                     f"compile ~{r['compile_s']:.1f} s (first call minus warm).")
    for r in result["rows"]:
        if r["impl"] == "attnkit-plan":
            lines.append(f"\nattnkit plan L={r['L']} block {r['block_size']}: {r['build_s'] * 1e3:.1f} ms, "
                         f"{r['plan_bytes'] / 2 ** 20:.1f} MiB.")
        if r["impl"] == "attnkit-numba first call":
            lines.append(f"\nfirst call (fresh process) L={r['L']}: import {r['import_s']:.2f} s, cold "
                         f"{r['cold_s'] * 1e3:.0f} ms, warm {r['warm_s'] * 1e3:.0f} ms.")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backward", action="store_true", help="also time forward+backward")
    ap.add_argument("--threads", type=int, default=None, help="torch (and numba) threads (default: torch's)")
    ap.add_argument("--window", type=int, default=256, help="keys each query sees, itself included")
    ap.add_argument("--block-sizes", type=_ints, default=[64], help="engine block sizes to time, e.g. 32,64,128")
    ap.add_argument("--dense-max", type=int, default=16384, help="longest L for SDPA (dense causal)")
    ap.add_argument("--flex-max", type=int, default=65536, help="longest L for FlexAttention")
    ap.add_argument("--torch-max", type=int, default=16384, help="longest L for the engine's torch path")
    ap.add_argument("--first-call-length", type=int, default=65536, help="L of the fresh-process first call (0: skip)")
    ap.add_argument("--skip", default="", help="comma-separated: sdpa, flex, attnkit-torch, attnkit-numba")
    ap.add_argument("--out", type=Path, default=None, help="write results: .json or .md")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.window < 1:
        ap.error("--repeats and --window must be >= 1")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.threads is not None:
        if args.threads < 1:
            ap.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rate = matmul_rate(args.repeats)
    print(f"float32 matmul: {rate / 1e9:.1f} GFLOP/s on {torch.get_num_threads()} threads", flush=True)
    rows: list[dict[str, Any]] = []
    for L in args.lengths:
        rows.extend(bench_length(L, args))
    if args.first_call_length:
        rows.append(first_call(args.first_call_length, args))
    result = {"cpu": _cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "window": args.window, "matmul_flops_per_s": rate, "command": " ".join(sys.argv), "rows": rows}
    table = markdown(result)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) if args.out.suffix == ".json" else table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
