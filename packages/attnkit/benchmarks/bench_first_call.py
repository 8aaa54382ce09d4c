"""First calls on an empty numba cache: what a test run (and a user's first call) pays for the kernels' builds.

For each mechanism, float32 then float64, on ``backend="numba"``, causal, ``(1, 2, --length, 16)``: a no-grad
forward in eval mode, then a training forward and backward (train mode); each first call's wall time, which is
almost all numba compiling the kernels it reaches (later calls of the same shapes take milliseconds). The numba
cache is a new temporary folder (``NUMBA_CACHE_DIR``, set before numba is imported), so nothing is cached from
an earlier run; a mechanism's kernels shared with one listed before it are counted once, where first reached.

    python packages/attnkit/benchmarks/bench_first_call.py routing lsh linear performer [--length 128]

To compare two revisions, run it with ``PYTHONPATH`` set to each checkout's ``packages/attnkit/src`` and
plugins' ``src`` folders. Figures: docs/benchmarks.md ("Session 59"). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

#: options beyond the defaults, per mechanism (smaller than the defaults where the defaults are slow to run)
OPTIONS = {"performer": {"num_features": 32}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="registered mechanisms with a numba backend")
    ap.add_argument("--length", type=int, default=128)
    args = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="attnkit-first-call-")
    os.environ["NUMBA_CACHE_DIR"] = cache
    import torch

    import attnkit

    print(f"# numba cache {cache}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    total = 0.0
    for name in args.names:
        for dt in (torch.float32, torch.float64):
            torch.manual_seed(0)
            attn = attnkit.build(name, num_heads=2, head_dim=16, backend="numba", **OPTIONS.get(name, {})).to(dt)
            q, k, v = (torch.randn(1, 2, args.length, 16, dtype=dt) for _ in range(3))
            t0 = time.perf_counter()
            with torch.no_grad():
                attn.eval()(q, k, v, causal=True)
            t1 = time.perf_counter()
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            attn.train()(*leaves, causal=True).sum().backward()
            t2 = time.perf_counter()
            total += t2 - t0
            print(f"{name:10s} {str(dt).removeprefix('torch.'):8s} no-grad forward {t1 - t0:6.1f} s   "
                  f"training step {t2 - t1:6.1f} s", flush=True)
    print(f"total {total:.1f} s")


if __name__ == "__main__":
    main()
