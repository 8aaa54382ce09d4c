"""Experiment (not used by the library or the tests): the sparse engine's fused backward ``backward_heads`` built
without ``parallel=True`` and run on two Python threads, against the shipped ``prange`` build.

``backward_heads`` is already a thin ``prange`` over the sequences around a plain ``@njit`` function,
``_backward_sequence``. The serial build is its own source with ``numba.prange(N)`` replaced by
``range(i0, i1)`` and the gradients passed in; two ``ThreadPoolExecutor`` threads run the two halves of the
sequences (the kernel is ``nogil``). The serial build is timed first: it compiles ``_backward_sequence``,
which the ``prange`` build then reuses, so the ``prange`` figure is what its wrapper alone costs on top. Each
build is swapped in as ``_numba_kernels.backward_heads``, which ``numba_ops`` looks up at every call.
Prints each build's first forward+backward (the forward compiled beforehand) and the median of alternated
timed steps: ``local``, window 256, float32, B = 1, H = 8, L = 8,192, D = 64, causal, torch on 2 threads.

    NUMBA_CACHE_DIR=$(mktemp -d) python plugins/attnkit-sparse/benchmarks/exp_engine_backward_build.py
"""

from __future__ import annotations

import inspect
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

import attnkit
from attnkit_sparse.engine import _numba_kernels as K

ALLOCS = ("dq = np.empty((N, L, D), dtype=q.dtype)", "dk = np.empty((N, S, D), dtype=q.dtype)",
          "dv = np.empty((N, S, E), dtype=q.dtype)")


def _serial_build():
    src = inspect.getsource(K.backward_heads.py_func)
    assert all(a in src for a in ALLOCS) and "numba.prange(N)" in src, "backward_heads changed: update this script"
    src = src.replace("def backward_heads(", "def backward_range(")
    src = src.replace("qT, doT):", "qT, doT, dq, dk, dv, i0, i1):")
    for a in ALLOCS:
        src = src.replace("    " + a + "\n", "")
    src = src.replace("for n in numba.prange(N):", "for n in range(i0, i1):")
    src = "\n".join(line for line in src.splitlines() if not line.startswith("@"))
    exec(src, K.__dict__)  # the module's helpers and constants are the new function's globals
    return numba.njit(fastmath=K.FASTMATH, nogil=True)(K.__dict__["backward_range"])


def main() -> None:
    kernel = _serial_build()
    pool = ThreadPoolExecutor(2)

    def on_threads(q, k, v, do, lse, delta, H, q_count, q_idx, q_tile, bank, bq, bk, cst, is32, qT, doT):
        N, L, D = q.shape
        S, E = k.shape[1], v.shape[2]
        dq, dk = np.empty((N, L, D), dtype=q.dtype), np.empty((N, S, D), dtype=q.dtype)
        dv = np.empty((N, S, E), dtype=q.dtype)
        args = (q, k, v, do, lse, delta, H, q_count, q_idx, q_tile, bank, bq, bk, cst, is32, qT, doT, dq, dk, dv)
        for f in [pool.submit(kernel, *args, a, b) for a, b in ((0, N // 2), (N // 2, N))]:
            f.result()
        return dq, dk, dv

    torch.set_num_threads(2)
    builds = {"serial on 2 threads": on_threads, "prange": K.backward_heads}
    x = torch.randn(1, 8, 8192, 64, requires_grad=True)
    g = torch.randn(1, 8, 8192, 64)
    attn = attnkit.build("local", window=256, backend="numba")
    with torch.no_grad():
        attn(x, x, x, causal=True)  # the forward's compile, outside the figures

    def step():
        x.grad = None
        attn(x, x, x, causal=True).backward(g)
        return x.grad.clone()

    grads, times = {}, {name: [] for name in builds}
    for name, fn in builds.items():
        K.backward_heads = fn
        t = time.perf_counter()
        grads[name] = step()
        print(f"{name}: first forward+backward (the backward's compile) {time.perf_counter() - t:.1f} s", flush=True)
    torch.testing.assert_close(grads["prange"], grads["serial on 2 threads"])
    for _ in range(4):
        for name, fn in builds.items():
            K.backward_heads = fn
            for _ in range(3):
                t = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name}: forward+backward median {statistics.median(ts) * 1e3:.1f} ms, "
              f"min {min(ts) * 1e3:.1f} ms over {len(ts)} steps")


if __name__ == "__main__":
    main()
