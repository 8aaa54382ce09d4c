"""CPU benchmark of the sparse patterns at their papers' settings: speed against SDPA, peak memory, index build.

Three tables, all measured in one run on this machine (float32, B=1, H=8, D=64):

* ``speed``: ``longformer`` (window 512, the first token global) and ``bigbird``
  (ITC: block 64, 3 window blocks, 2 global blocks, 3 random blocks), both
  bidirectional as in their papers, built with ``attnkit.build`` on the numba
  backend, against SDPA (dense, non-causal); forward under ``torch.no_grad``
  and forward+backward; median of ``--repeats`` after one warm-up; the crossover
  is the shortest L from which the pattern is faster.
* ``memory``: peak resident memory of one forward+backward of each pattern and of
  SDPA, each in a fresh process after one warm-up call (Linux: the high-water mark
  ``VmHWM``, reset just before the call, minus ``VmRSS`` then; inputs, loaded
  kernels and the cached plan already resident), so the growth with L can be read.
* ``index``: block-index build time at ``--index-length`` (default 65,536) for every
  pattern with its default options, bidirectional and causal where it has a causal
  form (a fresh module and mask each time: nothing cached; best of 3), 64 x 64 tiles.

    python plugins/attnkit-sparse/benchmarks/bench_patterns.py --lengths 1024,2048,4096,8192,16384 \\
        --repeats 3 --out bench_patterns.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import attnkit

B, H, D = 1, 8, 64
#: compared with SDPA; their defaults are their papers' settings (`attnkit describe NAME` says so)
PAPER = ("longformer", "bigbird")
PATTERNS = ("local", "dilated", "block-local", "global", "random", "longformer", "bigbird", "strided", "fixed",
            "local-2d", "axial", "bp-transformer")


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _build(name: str, backend: str = "numba") -> attnkit.Attention:
    return attnkit.build(name, num_heads=H, head_dim=D, backend=backend).eval()


def _runner(name: str, L: int, grad: bool) -> Callable[[], None]:
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for _ in range(3))
    if name == "sdpa":
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    else:
        attn = _build(name)
        fn = lambda: attn(q, k, v)  # noqa: E731
    if not grad:
        def run() -> None:
            with torch.no_grad():
                fn()
        return run

    def run_bwd() -> None:
        out = fn()
        out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None
    return run_bwd


def speed(lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for L in lengths:
        for mode in ("fwd", "fwd+bwd"):
            base = _median(_runner("sdpa", L, mode == "fwd+bwd"), repeats)
            for name in PAPER:
                t = _median(_runner(name, L, mode == "fwd+bwd"), repeats)
                rows.append({"L": L, "mode": mode, "impl": name, "median_s": t, "sdpa_s": base, "speedup": base / t})
                print(f"  L={L:6d} {mode:8s} {name:11s} {t * 1e3:9.1f} ms   sdpa {base * 1e3:9.1f} ms   "
                      f"{base / t:6.2f}x", flush=True)
    return rows


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_child(name: str, L: int) -> None:
    """Peak resident memory of one forward+backward above the resident memory just before it (Linux)."""
    run = _runner(name, L, True)
    run()  # warm: numba loads its compiled kernels, the engine builds and caches its plan
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    run()
    peak = _status_kib("VmHWM")
    print(json.dumps({"peak_mib": (peak - before) / 1024}))


def memory(lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for L in lengths:
        for name in ("sdpa", *PAPER):
            # a fresh process per cell: ru_maxrss only grows, so cells must not share one
            res = subprocess.run([sys.executable, __file__, "--peak-child", name, str(L)], capture_output=True,
                                 text=True, check=False)
            if res.returncode != 0:
                rows.append({"L": L, "impl": name, "error": res.stderr.strip().splitlines()[-1:]})
                print(f"  L={L:6d} {name:11s} failed: {res.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            peak = json.loads(res.stdout.strip().splitlines()[-1])["peak_mib"]
            rows.append({"L": L, "impl": name, "peak_mib": peak})
            print(f"  L={L:6d} {name:11s} peak {peak:9.1f} MiB (fwd+bwd, above the process before the call)",
                  flush=True)
    return rows


def index(L: int) -> list[dict[str, Any]]:
    rows = []
    for name in PATTERNS:
        spec = attnkit.get_spec(name)
        forms = [False] + ([True] if spec.capabilities.causal else [])
        for causal in forms:
            best = float("inf")
            for _ in range(3):
                attn = attnkit.build(name, num_heads=H, head_dim=D)  # defaults (2-D grids: square for square L)
                mask = attn.pattern_mask(L, L, causal=causal)
                t0 = time.perf_counter()
                bi = mask.block_index(B, H, L, L, block_size=64)
                best = min(best, time.perf_counter() - t0)
            rows.append({"pattern": name, "causal": causal, "L": L, "seconds": best, "density": bi.density})
            print(f"  {name:15s} {'causal' if causal else 'bidir':6s} L={L}: {best * 1e3:8.1f} ms "
                  f"(tile density {bi.density:.4f})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192,
                                                                                          16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--index-length", type=int, default=65536)
    ap.add_argument("--skip", default="", help="comma-separated: speed, memory, index")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--peak-child", nargs=2, metavar=("NAME", "L"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peak_child:
        _peak_child(args.peak_child[0], int(args.peak_child[1]))
        return 0
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                           "command": " ".join(sys.argv)}
    if "speed" not in args.skip:
        print("speed (median):", flush=True)
        out["speed"] = speed(args.lengths, args.repeats)
    if "memory" not in args.skip:
        print("peak memory:", flush=True)
        out["memory"] = memory(args.lengths)
    if "index" not in args.skip:
        print(f"block index at L={args.index_length}:", flush=True)
        out["index"] = index(args.index_length)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
