"""The numba thread pool that plugins' CPU kernels share: started with passive idle threads, sized by torch.

numba is imported by these functions, never by ``import attnkit`` (the core does
not need it); a plugin's numba backend module calls :func:`start_pool` before it
compiles or loads its kernels and launches them with :func:`run_parallel`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["start_pool", "kernel_threads", "run_parallel"]


def start_pool() -> None:
    """Start numba's thread pool with idle threads that sleep instead of spinning (idempotent).

    With the ``omp`` threading layer numba runs its own copy of libgomp next to
    the one bundled with torch; idle GNU OpenMP threads busy-wait by default,
    so after every kernel call numba's threads would spin on the cores torch's
    next operation needs (measured: SDPA and the feature maps ran ~2x slower
    on 2 cores). libgomp reads ``OMP_WAIT_POLICY`` when it is loaded, which
    happens when numba launches its threads, so it is set to ``PASSIVE`` for
    that moment only (unless the user set it) and restored afterwards.
    torch's own pool is not affected.
    """
    import numba

    key = "OMP_WAIT_POLICY"
    user_set = key in os.environ
    if not user_set:
        os.environ[key] = "PASSIVE"
    try:
        numba.get_num_threads()  # launches the pool (and loads numba's libgomp) once
    finally:
        if not user_set:
            os.environ.pop(key, None)


def kernel_threads() -> int:
    """Threads a kernel call uses: ``torch.get_num_threads()``, capped by the threads numba launched.

    numba's pool and torch's intra-op pool are separate; a kernel running on
    more threads than torch is told to use oversubscribes the cores other
    work (a data loader, a second process, ``torch.set_num_threads(1)`` in a
    worker) was left, and every thread then waits on the slowest one.
    """
    import numba

    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def run_parallel(kernel: Any, *args: Any, items: int | None = None) -> Any:
    """Call a ``parallel=True`` kernel on :func:`kernel_threads` threads; numba's settings are restored after.

    Args:
        kernel: the compiled kernel.
        *args: its arguments.
        items: the kernel's ``prange`` work items. Given: one chunk of about ``items / threads`` per
            thread (numba's chunked scheduling costs about 1 ms per chunk: measured on the sparse
            engine, 16 chunks per thread made a 1K forward+backward 110 ms instead of 23 ms). None:
            chunk size 1, the items handed out one at a time, so a thread slowed by a busy core takes
            fewer (the kernelized family's few, long B·H sequences).
    """
    import numba

    threads = kernel_threads()
    old_threads = numba.get_num_threads()
    numba.set_num_threads(threads)
    old = numba.set_parallel_chunksize(1 if items is None else max(1, -(-items // threads)))
    try:
        return kernel(*args)
    finally:
        numba.set_parallel_chunksize(old)
        numba.set_num_threads(old_threads)
