"""Experiment (not used by the library or the tests): the sparse engine's ``forward`` kernel built without
``parallel=True`` and run on two Python threads, against the shipped ``prange`` build.

The serial build is the shipped kernel's own source with ``numba.prange(N * NQ)`` replaced by
``range(i0, i1)`` and the outputs passed in; two ``ThreadPoolExecutor`` threads run the two halves of the
work items (the kernel is ``nogil``). Each build is swapped in as ``_numba_kernels.forward``, which
``numba_ops`` looks up at every call. The script prints each build's first call (its compile, on an empty
``NUMBA_CACHE_DIR``) and the median of alternated timed calls: ``local``, window 256, float32, B = 1,
H = 8, L = 8,192, D = 64, causal, torch on 2 threads.

    NUMBA_CACHE_DIR=$(mktemp -d) python plugins/attnkit-sparse/benchmarks/exp_engine_forward_build.py
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

HEAD = "def forward(q, k, v, H, kv_count, kv_idx, kv_tile, bank, span, bq, bk, cst, is32):"


def _serial_build():
    src = inspect.getsource(K.forward.py_func)
    assert HEAD in src and "numba.prange(N * NQ)" in src, "the engine's forward changed: update this experiment"
    src = src.replace(HEAD, HEAD.replace("forward(", "forward_range(").replace("is32)", "is32, out, lse, i0, i1)"))
    src = src.replace("    out = np.empty((N, L, E), dtype=q.dtype)\n", "")
    src = src.replace("    lse = np.empty((N, L), dtype=q.dtype)\n", "")
    src = src.replace("for it in numba.prange(N * NQ):", "for it in range(i0, i1):")
    src = "\n".join(line for line in src.splitlines() if not line.startswith("@"))
    exec(src, K.__dict__)  # the module's helpers and constants are the new function's globals
    return numba.njit(fastmath=K.FASTMATH, nogil=True)(K.__dict__["forward_range"])


def main() -> None:
    kernel = _serial_build()
    pool = ThreadPoolExecutor(2)

    def on_threads(q, k, v, H, kv_count, kv_idx, kv_tile, bank, span, bq, bk, cst, is32):
        N, L, _ = q.shape
        n = N * kv_count.shape[2]
        out = np.empty((N, L, v.shape[2]), dtype=q.dtype)
        lse = np.empty((N, L), dtype=q.dtype)
        args = (q, k, v, H, kv_count, kv_idx, kv_tile, bank, span, bq, bk, cst, is32, out, lse)
        for f in [pool.submit(kernel, *args, a, b) for a, b in ((0, n // 2), (n // 2, n))]:
            f.result()
        return out, lse

    torch.set_num_threads(2)
    builds = {"prange": K.forward, "serial on 2 threads": on_threads}
    x = torch.randn(1, 8, 8192, 64)
    attn = attnkit.build("local", window=256, backend="numba")
    outs, times = {}, {name: [] for name in builds}
    with torch.no_grad():
        for name, fn in builds.items():
            K.forward = fn
            t = time.perf_counter()
            outs[name] = attn(x, x, x, causal=True)
            print(f"{name}: first call (compile) {time.perf_counter() - t:.1f} s", flush=True)
        torch.testing.assert_close(outs["prange"], outs["serial on 2 threads"])
        for _ in range(5):
            for name, fn in builds.items():
                K.forward = fn
                for _ in range(3):
                    t = time.perf_counter()
                    attn(x, x, x, causal=True)
                    times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms, min {min(ts) * 1e3:.1f} ms over {len(ts)} calls")


if __name__ == "__main__":
    main()
