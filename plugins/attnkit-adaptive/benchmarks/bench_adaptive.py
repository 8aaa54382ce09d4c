"""Benchmarks of attnkit-adaptive (CPU): does adaptive-span's cost follow the span; entmax against softmax.

Part ``span`` (L = 8,192, B = 1, H = 2, D = 64, float32, causal):
  * ``adaptive-span`` with every head's span at 64 (ramp 32, max_span 8,192), block 64 and 32;
  * the same module with span 8,192 (the band covers the whole sequence);
  * SDPA causal (``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``);
  * for the record, the sparse engine's hard causal window of the same reach (``local``, window 96,
    numba backend) when attnkit-sparse is installed: the engine cannot run the soft ramp
    (it refuses additive biases), this is what a hard window costs there.
Part ``entmax`` (B = 1, H = 1, D = 64, float32, not causal, L = 512 .. 8,192):
  * ``entmax`` (our bisection, alpha 1.5 learned), the ``entmax`` package's ``entmax_bisect`` on the
    same scores (when installed), softmax by SDPA and by the naive matmul-softmax-matmul.

Forward and forward+backward, the median of ``--repeats`` runs after one warm-up; raw results as
JSON and a markdown table in ``benchmarks/results/``. Timings are never asserted in tests.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-adaptive/benchmarks/bench_adaptive.py
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
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


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (and numba compile)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def fwd_and_bwd(make_out, inputs, repeats: int) -> tuple[float, float]:
    def fwd():
        with torch.no_grad():
            make_out()

    def fwd_bwd():
        for t in inputs:
            t.grad = None
        make_out().sum().backward()

    return timed(fwd, repeats), timed(fwd_bwd, repeats)


def bench_span(repeats: int, L: int) -> list[dict]:
    B, H, D = 1, 2, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3))
    rows = []

    def add(label, fn, extra=None):
        f, fb = fwd_and_bwd(fn, (q, k, v), repeats)
        rows.append({"case": label, "L": L, "fwd_s": f, "fwd_bwd_s": fb, **(extra or {})})
        print(f"  {label:45s} fwd {f * 1e3:9.1f} ms   fwd+bwd {fb * 1e3:9.1f} ms", flush=True)

    for span, block in ((64, 64), (64, 32), (L, 64)):
        attn = attnkit.build("adaptive-span", num_heads=H, max_span=L, ramp=32.0, init_span=float(span),
                             block_size=block)
        add(f"adaptive-span span={span} block={block}", lambda a=attn: a(q, k, v, causal=True),
            {"span": span, "block": block})
    add("sdpa causal", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    try:
        local = attnkit.build("local", window=96, backend="numba")
        add("sparse engine local window=96 (numba, hard mask)", lambda: local(q, k, v, causal=True))
    except Exception as e:  # noqa: BLE001 - attnkit-sparse not installed: recorded, not fatal
        print(f"  sparse engine: not measured ({type(e).__name__}: {e})")
    return rows


def _entmax_at(L: int, repeats: int, package_bisect) -> list[dict]:
    B, H, D = 1, 1, 64
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3))
    ent = attnkit.build("entmax", num_heads=H, alpha=1.5)
    naive = attnkit.build("softmax", backend="torch")
    cases = [("entmax (attnkit-adaptive bisection)", lambda: ent(q, k, v)),
             ("softmax sdpa", lambda: F.scaled_dot_product_attention(q, k, v)),
             ("softmax naive (torch)", lambda: naive(q, k, v))]
    if package_bisect is not None:
        def pkg():
            s = torch.matmul(q, k.transpose(-1, -2)) * D ** -0.5
            a = ent.alphas(s.dtype).view(1, -1, 1, 1).expand(B, H, L, 1)
            return torch.matmul(package_bisect(s, a, dim=-1, n_iter=50), v)
        cases.append(("entmax package 1.3 entmax_bisect (n_iter=50)", pkg))
    rows = []
    for label, fn in cases:
        f, fb = fwd_and_bwd(fn, (q, k, v), repeats)
        rows.append({"case": label, "L": L, "fwd_s": f, "fwd_bwd_s": fb, "repeats": repeats})
        print(f"  L={L:5d} {label:45s} fwd {f * 1e3:9.1f} ms   fwd+bwd {fb * 1e3:9.1f} ms", flush=True)
    return rows


def bench_entmax(repeats: int, lengths: list[int]) -> list[dict]:
    try:
        from entmax import entmax_bisect as package_bisect
    except ImportError:
        package_bisect = None
    rows = []
    for L in lengths:
        rows += _entmax_at(L, 1 if L >= 4096 else repeats, package_bisect)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("span", "entmax", "all"), default="all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--length", type=int, default=8192, help="span part: L")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192], help="entmax part")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    before = uptime()
    print("uptime before:", before, flush=True)
    res = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "uptime_before": before, "repeats": args.repeats}
    if args.part in ("span", "all"):
        print(f"adaptive-span, L={args.length}, B=1, H=2, D=64, float32, causal:", flush=True)
        res["span"] = bench_span(args.repeats, args.length)
    if args.part in ("entmax", "all"):
        print("entmax vs softmax, B=1, H=1, D=64, float32:", flush=True)
        res["entmax"] = bench_entmax(args.repeats, args.lengths)
    res["uptime_after"] = uptime()
    print("uptime after:", res["uptime_after"], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    (out / f"bench_adaptive-{args.part}-{stamp}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / f'bench_adaptive-{args.part}-{stamp}.json'}")


if __name__ == "__main__":
    main()
