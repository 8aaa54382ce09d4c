"""``lsh`` on CPU before and after a change, in one process, alternated call by call, with SDPA beside them.

The "before" ``lsh/`` package is read from a git commit (``--before``) into a temporary directory and
imported as ``attnkit_sparse.lsh_old`` (its relative imports resolve to the installed plugin's engine
and helpers), so both run on the same engine, the same torch and the same load::

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/bench_lsh_before_after.py \\
        --before 273d38b --repeats 5

float32, B = 1, H = 8, D = 64, bidirectional, shared-QK (``k = q``), 4 hash rounds, buckets of 64, torch's
thread count (``--threads``, default 2). Forward under ``no_grad``; forward+backward of ``out.sum()``.
Medians (and minima) of ``--repeats`` calls after one warm-up each.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

FILES = ("__init__", "attention", "hashing", "rounds", "_numba", "naive")


def load_before(commit: str, tmp: str):
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    pkg = os.path.join(tmp, "lsh_old")
    os.makedirs(pkg)
    for name in FILES:
        src = subprocess.run(["git", "show", f"{commit}:plugins/attnkit-sparse/src/attnkit_sparse/lsh/{name}.py"],
                             capture_output=True, text=True, cwd=root)
        if src.returncode == 0:
            with open(os.path.join(pkg, f"{name}.py"), "w") as f:
                f.write(src.stdout)
    import attnkit_sparse  # noqa: F401  -- the parent package of lsh_old
    spec = importlib.util.spec_from_file_location("attnkit_sparse.lsh_old", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attnkit_sparse.lsh_old"] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module("attnkit_sparse.lsh_old.attention").LSHAttention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git commit of the 'before' lsh/ package")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the medians as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import attnkit_sparse
    from attnkit_sparse.lsh.attention import LSHAttention as After
    print(f"# {os.uname().nodename}: {open('/proc/loadavg').read().split()[:3]} load; torch {torch.__version__}, "
          f"{args.threads} threads; after = {os.path.dirname(attnkit_sparse.__file__)}, before = {args.before}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        Before = load_before(args.before, tmp)
        L, B, H, D = args.length, 1, 8, 64
        torch.manual_seed(0)
        q, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
        after = After(bucket_size=64, n_hashes=4, backend="numba")
        before = Before(bucket_size=64, n_hashes=4, backend="numba")
        before.spec = after.spec                         # the registered spec (backends, capabilities)
        mods = {"before": before, "after": after}
        with torch.no_grad():
            diff = (before(q, q, v) - after(q, q, v)).abs().max().item()
        print(f"max |before - after| (forward): {diff:.2e}", flush=True)

        def fwd(m):
            def f():
                with torch.no_grad():
                    m(q, q, v)
            return f

        def fb(m):
            def f():
                a, b = q.clone().requires_grad_(), v.clone().requires_grad_()
                m(a, a, b).sum().backward()
            return f

        def sdpa():
            with torch.no_grad():
                torch.nn.functional.scaled_dot_product_attention(q, q, v)

        result = {"length": L, "threads": args.threads, "before": args.before, "max_abs_diff": diff}
        for mode in ("forward", "forward_backward"):
            fs = {k: (fwd(m) if mode == "forward" else fb(m)) for k, m in mods.items()}
            if mode == "forward":
                fs["sdpa"] = sdpa
            for f in fs.values():
                f()
            ts: dict[str, list[float]] = {k: [] for k in fs}
            for _ in range(args.repeats):
                for k, f in fs.items():
                    t0 = time.perf_counter()
                    f()
                    ts[k].append(time.perf_counter() - t0)
            med = {k: sorted(x)[len(x) // 2] for k, x in ts.items()}
            result[mode] = {k: {"median_s": med[k], "min_s": min(ts[k])} for k in ts}
            print(mode, "  ".join(f"{k} {med[k]:.3f} s (min {min(ts[k]):.3f})" for k in ts), flush=True)
            print(f"{mode}: after is {med['before'] / med['after']:.2f}x faster than before", flush=True)
            if mode == "forward":
                sb, sa = med["sdpa"] / med["before"], med["sdpa"] / med["after"]
                print(f"forward vs SDPA: before {sb:.2f}x, after {sa:.2f}x", flush=True)
        print(f"# load at the end: {open('/proc/loadavg').read().split()[:3]}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
