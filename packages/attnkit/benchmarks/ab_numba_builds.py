"""Time the numba paths of two source trees against each other, in alternated processes (one tree per process).

Each child process imports attnkit and the plugins from one tree (``PYTHONPATH`` set to its ``src`` folders, ahead
of the installed copies), warms the path up (its numba compile is not timed), then prints the median of
``--repeats`` calls, forward (no grad) and forward+backward, per case: float32, B = 1, H = 8, D = 64. Used for the
serial-kernel experiment in docs/benchmarks.md ("CI time"); e.g. against the branch that holds it::

    git worktree add /tmp/exp experiment/serial-numba-kernels
    python packages/attnkit/benchmarks/ab_numba_builds.py . /tmp/exp --set adaptive --rounds 3

Each tree keeps its own ``NUMBA_CACHE_DIR``. Quote only runs on an otherwise idle machine. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SETS = ("kernelized", "sparse", "adaptive")
SRC = ("packages/attnkit/src", "plugins/attnkit-kernelized/src", "plugins/attnkit-sparse/src",
       "plugins/attnkit-adaptive/src")


def _cases(which: str):
    """``(label, module, L, causal, shared_qk)`` of a set."""
    import attnkit

    H, D = 8, 64
    if which == "kernelized":
        for L in (1024, 8192):
            yield "linear", attnkit.build("linear", num_heads=H, head_dim=D, backend="numba"), L, True, False
            yield ("performer", attnkit.build("performer", num_heads=H, head_dim=D, num_features=256,
                                              backend="numba"), L, True, False)
        for L in (1024, 4096):   # token loops (the gated recurrence, the delta rule): slower, shorter lengths
            yield "rfa", attnkit.build("rfa", num_heads=H, head_dim=D, backend="numba"), L, True, False
            yield "fast-weight", attnkit.build("fast-weight", num_heads=H, head_dim=D, backend="numba"), L, True, False
    elif which == "sparse":
        for L in (1024, 8192):
            yield "local w256", attnkit.build("local", window=256, backend="numba"), L, True, False
            yield ("routing", attnkit.build("routing", num_clusters=max(1, L // 256), num_heads=H, head_dim=D,
                                            backend="numba").eval(), L, False, False)
            yield "lsh", attnkit.build("lsh", bucket_size=64, n_hashes=4, backend="numba"), L, False, True
    else:
        for L in (1024, 8192):
            yield ("adaptive-span 64", attnkit.build("adaptive-span", num_heads=H, max_span=L, ramp=32.0,
                                                     init_span=64.0, block_size=64), L, True, False)


def _time_case(mod, L: int, causal: bool, shared: bool, repeats: int) -> tuple[float, float]:
    """Median milliseconds of the forward (no grad) and of forward+backward, after one untimed call of each
    (:func:`attnkit.tuning._median_seconds`, the timer ``attnkit tune`` uses)."""
    import torch

    from attnkit.tuning import _median_seconds

    cpu = torch.device("cpu")
    q, k, v = (torch.randn(1, 8, L, 64) for _ in range(3))
    k = q if shared else k
    with torch.no_grad():
        fwd = _median_seconds(lambda: mod(q, k, v, causal=causal), repeats, cpu) * 1e3
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))

    def step():
        mod(qq, qq if shared else kk, vv, causal=causal).sum().backward()

    return fwd, _median_seconds(step, repeats, cpu) * 1e3


def child(which: str, repeats: int, threads: int, only: list[str], lengths: list[int]) -> None:
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    for label, mod, L, causal, shared in _cases(which):
        if (only and label not in only) or (lengths and L not in lengths):
            continue
        fwd, fwdbwd = _time_case(mod, L, causal, shared, repeats)
        print(json.dumps({"case": label, "L": L, "fwd_ms": round(fwd, 2), "fwdbwd_ms": round(fwdbwd, 2)}),
              flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="*", help="two source trees (repository roots): A then B")
    p.add_argument("--set", dest="which", choices=SETS, required=True)
    p.add_argument("--rounds", type=int, default=3, help="processes per tree, alternated")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per case (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in the children")
    p.add_argument("--only", nargs="*", default=[], metavar="CASE",
                   help="run only these cases of the set (their labels, e.g. linear performer)")
    p.add_argument("--lengths", nargs="*", type=int, default=[], metavar="L", help="run only these lengths")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.which, args.repeats, args.threads, args.only, args.lengths)
        return 0
    if len(args.trees) != 2:
        p.error(f"trees: expected two repository roots (A and B), got {len(args.trees)}")
    roots = [Path(t).resolve() for t in args.trees]
    caches = [tempfile.mkdtemp(prefix=f"ab_numba_{i}_") for i in range(2)]
    for _ in range(args.rounds):
        for tag, root, cache in zip("AB", roots, caches):
            env = dict(os.environ, NUMBA_CACHE_DIR=cache,
                       PYTHONPATH=os.pathsep.join(str(root / s) for s in SRC))
            out = subprocess.run([sys.executable, __file__, "--child", "--set", args.which, "--repeats",
                                  str(args.repeats), "--threads", str(args.threads), "--only", *args.only,
                                  "--lengths", *map(str, args.lengths)],
                                 env=env, capture_output=True, text=True, check=True)
            for line in out.stdout.splitlines():
                print(tag, line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
