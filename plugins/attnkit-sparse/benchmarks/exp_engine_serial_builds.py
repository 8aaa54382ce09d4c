"""Experiment (not used by the library or the tests): a sparse engine kernel built without ``parallel=True`` and
run on two Python threads, against the shipped ``prange`` build: compile time and run time.

The serial build is the shipped kernel's own source with its ``numba.prange`` loop replaced by
``range(i0, i1)`` and its outputs passed in; two threads (the calling one and one of
:func:`attnkit.numba_pool.run_items`'s helpers) run the two halves of the
work items (the kernels are ``nogil``). Each build is swapped in on ``_numba_kernels``, which ``numba_ops``
reads at every call. ``local``, window 256, float32, B = 1, H = 8, D = 64, causal, torch on 2 threads.

* ``--kernel forward``: ``forward`` (its loop body inside the ``prange``). Prints each build's first call
  (its compile) and the forward's median over alternated calls.
* ``--kernel backward``: ``backward_heads``, already a thin ``prange`` over the sequences around the plain
  ``@njit`` function ``_backward_sequence``. The serial build runs first: it compiles ``_backward_sequence``,
  which the ``prange`` build then reuses, so the ``prange`` figure is what its wrapper alone costs on top.
  Prints each build's first forward+backward (the forward compiled beforehand) and the median step.

    NUMBA_CACHE_DIR=$(mktemp -d) python plugins/attnkit-sparse/benchmarks/exp_engine_serial_builds.py --kernel forward
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import numba
import numpy as np
import torch

import attnkit
from attnkit.numba_pool import run_items
from attnkit_sparse.engine import _numba_kernels as K

#: per kernel: its name, the outputs it allocates (moved to the caller), its prange loop, and how many work items
#: that loop has, from the kernel's arguments
KERNELS = {
    "forward": ("forward", ("out = np.empty((N, L, E), dtype=q.dtype)", "lse = np.empty((N, L), dtype=q.dtype)"),
                "for it in numba.prange(N * NQ):", lambda args: args[0].shape[0] * args[4].shape[2]),
    "backward": ("backward_heads", ("dq = np.empty((N, L, D), dtype=q.dtype)",
                                    "dk = np.empty((N, S, D), dtype=q.dtype)",
                                    "dv = np.empty((N, S, E), dtype=q.dtype)"),
                 "for n in numba.prange(N):", lambda args: args[0].shape[0]),
}


def serial_build(which: str):
    """The kernel's source as a serial ``nogil`` function of ``(*its arguments, *its outputs, i0, i1)``."""
    name, allocs, loop, _ = KERNELS[which]
    src = inspect.getsource(getattr(K, name).py_func)
    assert all(a in src for a in allocs) and loop in src, f"{name} changed: update this experiment"
    start = src.index(f"def {name}(")
    head = src[start:src.index("):", start) + 2]
    outs = ", ".join(a.split(" = ")[0] for a in allocs)
    src = src.replace(head, head.replace(f"def {name}(", "def serial_range(").replace("):", f", {outs}, i0, i1):"))
    for a in allocs:
        src = src.replace("    " + a + "\n", "")
    src = src.replace(loop, loop.split(" in ")[0] + " in range(i0, i1):")
    src = "\n".join(line for line in src.splitlines() if not line.startswith("@"))
    exec(src, K.__dict__)  # the module's helpers and constants are the new function's globals
    return numba.njit(fastmath=K.FASTMATH, nogil=True)(K.__dict__["serial_range"])


def on_threads(which: str):
    """A drop-in for the shipped kernel: allocates its outputs (the kernel's own expressions) and runs the serial
    build over two halves of the work items on two threads (:func:`attnkit.numba_pool.run_items`)."""
    _, allocs, _, items = KERNELS[which]
    kernel = serial_build(which)

    def run(*args):
        q, k, v = args[:3]
        N, L, D = q.shape
        shapes = {"np": np, "q": q, "N": N, "L": L, "D": D, "S": k.shape[1], "E": v.shape[2]}
        outs = [eval(a.split(" = ")[1], shapes) for a in allocs]
        n = items(args)
        run_items(lambda i: kernel(*args, *outs, i * n // 2, (i + 1) * n // 2), 2, threads=2)
        return tuple(outs)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="forward")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds of 3 timed calls per build")
    args = ap.parse_args()
    name = KERNELS[args.kernel][0]
    torch.set_num_threads(2)
    serial = ("serial on 2 threads", on_threads(args.kernel))
    shipped = ("prange", getattr(K, name))
    builds = dict([serial, shipped] if args.kernel == "backward" else [shipped, serial])
    x = torch.randn(1, 8, args.length, 64, requires_grad=args.kernel == "backward")
    g = torch.randn(1, 8, args.length, 64)
    attn = attnkit.build("local", window=256, backend="numba")

    def call():
        if args.kernel == "forward":
            with torch.no_grad():
                return attn(x, x, x, causal=True)
        x.grad = None
        attn(x, x, x, causal=True).backward(g)
        return x.grad.clone()

    if args.kernel == "backward":
        with torch.no_grad():
            attn(x, x, x, causal=True)  # the forward's compile, outside the figures
    results, times = {}, {b: [] for b in builds}
    for b, fn in builds.items():
        setattr(K, name, fn)
        t = time.perf_counter()
        results[b] = call()
        print(f"{b}: first call (the {name} compile) {time.perf_counter() - t:.1f} s", flush=True)
    torch.testing.assert_close(*results.values())
    for _ in range(args.rounds):
        for b, fn in builds.items():
            setattr(K, name, fn)
            for _ in range(3):
                t = time.perf_counter()
                call()
                times[b].append(time.perf_counter() - t)
    for b, ts in times.items():
        print(f"{b}: median {statistics.median(ts) * 1e3:.1f} ms, min {min(ts) * 1e3:.1f} ms over {len(ts)} calls")


if __name__ == "__main__":
    main()
