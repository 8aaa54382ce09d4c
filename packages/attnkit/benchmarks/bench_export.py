"""What an exported program costs against the eager module (the figures in docs/user-guide.md, "torch.export").

While ``torch.export`` traces, ``backend="auto"`` runs the ``torch`` backend (a program of ATen operators). Per
mechanism, float32, eval, no gradient, B = 1, H = 8, D = 64: the median forward time of the eager module on its
automatic backend, of the eager module forced onto ``torch``, and of the exported program (saved and loaded),
in one process, alternating the three in each round::

    python packages/attnkit/benchmarks/bench_export.py [--length 4096] [--rounds 7] [--only NAME ...] [--dynamic]

``--dynamic`` adds a fourth: the program exported at L/4 with the length declared dynamic, run at L ("-" where
the export fixes the length).
"""

from __future__ import annotations

import argparse
import io
import platform
import statistics
import time
import warnings

import torch
from probe_func_export import _Call  # (this script's folder is on sys.path when it runs)

import attnkit

DEFAULT = ("softmax", "local", "bigbird", "performer", "linear", "nystrom", "lsh", "routing", "sinkhorn")


def _build(name: str, backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return attnkit.build(name, num_heads=8, head_dim=64, backend=backend).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", nargs="*", default=list(DEFAULT))
    ap.add_argument("--dynamic", action="store_true",
                    help="also a program exported with the length dynamic (at L/4), timed at L")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, L = {args.length}, medians of {args.rounds} rounds")
    dyn = "   dynamic L  dynamic / auto" if args.dynamic else ""
    print(f"{'mechanism':18s} {'eager auto':>12s} {'eager torch':>12s} {'program':>12s} {'program / auto':>15s}{dyn}")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, args.length, 64, generator=g) for _ in range(3))
    for name in args.only:
        causal = bool(attnkit.get_spec(name).capabilities.causal)
        auto, plain = _Call(_build(name, "auto"), causal), _Call(_build(name, "torch"), causal)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = {"auto": auto, "torch": plain, "program": _saved_program(name, causal, (q, k, v), None)}
            if args.dynamic:
                # exported at a quarter of the length, the length declared dynamic, timed at the full length
                top = auto.attn.limits.max_length or max(4096, 2 * args.length)   # (linformer: its max_length)
                length = torch.export.Dim("L", min=1, max=top)
                example = tuple(t[:, :, :max(2, args.length // 4)].contiguous() for t in (q, k, v))
                try:
                    runs["dynamic"] = _saved_program(name, causal, example, ({2: length},) * 3)
                except Exception as exc:  # noqa: BLE001 - reported in the table: the export fixes the length
                    print(f"  ({name}: no dynamic-length program: {str(exc).splitlines()[0][:90]})")
            want = auto(q, k, v)
            for f in runs.values():   # warm-up, and the three agree
                torch.testing.assert_close(f(q, k, v), want, rtol=1e-3, atol=1e-4)
            times: dict[str, list[float]] = {n: [] for n in runs}
            for r in range(args.rounds):
                for n in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                    t = time.perf_counter()
                    runs[n](q, k, v)
                    times[n].append(time.perf_counter() - t)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        extra = "" if not args.dynamic else (
            f" {med['dynamic']:10.1f}ms {med['dynamic'] / med['auto']:14.2f}x" if "dynamic" in med else
            f" {'-':>12s} {'-':>15s}")
        print(f"{name:18s} {med['auto']:10.1f}ms {med['torch']:10.1f}ms {med['program']:10.1f}ms "
              f"{med['program'] / med['auto']:14.2f}x{extra}", flush=True)


def _saved_program(name: str, causal: bool, example: tuple, shapes: tuple | None) -> torch.nn.Module:
    """The program of a fresh module on ``auto``, exported (``shapes``: dynamic_shapes), saved and loaded."""
    buf = io.BytesIO()
    torch.export.save(torch.export.export(_Call(_build(name, "auto"), causal), example, dynamic_shapes=shapes),
                      buf)
    buf.seek(0)
    return torch.export.load(buf).module()


if __name__ == "__main__":
    main()
