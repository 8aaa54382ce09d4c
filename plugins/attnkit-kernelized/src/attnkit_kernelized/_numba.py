"""What the numba kernels share: the thread pool, dynamic scheduling, fastmath flags, array views.

Importing this module imports numba and starts its thread pool; only the
``numba_ops`` modules import it, on the first use of the numba backend.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from torch import Tensor


def _launch_numba_threads() -> None:
    """Start numba's thread pool with idle threads that sleep instead of spinning.

    With the ``omp`` threading layer numba runs its own copy of libgomp next to
    the one bundled with torch; idle GNU OpenMP threads busy-wait by default,
    so after every kernel call numba's threads would spin on the cores torch's
    next operation needs (measured: SDPA and the feature maps ran ~2x slower
    on 2 cores). libgomp reads ``OMP_WAIT_POLICY`` when it is loaded, which
    happens when numba launches its threads, so it is set to ``PASSIVE`` for
    that moment only (unless the user set it) and restored afterwards.
    torch's own pool is not affected.
    """
    key = "OMP_WAIT_POLICY"
    user_set = key in os.environ
    if not user_set:
        os.environ[key] = "PASSIVE"
    try:
        numba.get_num_threads()  # launches the pool (and loads numba's libgomp) once
    finally:
        if not user_set:
            os.environ.pop(key, None)


_launch_numba_threads()

# reassociation lets LLVM vectorise the short reductions; no NaN/inf
# assumptions, so zeros from masked positions and NaN inputs behave exactly
FASTMATH = {"reassoc", "contract", "nsz"}


def kernel_threads() -> int:
    """Threads a kernel call uses: ``torch.get_num_threads()``, capped by the threads numba launched.

    numba's pool and torch's intra-op pool are separate; a kernel running on
    more threads than torch is told to use oversubscribes the cores other
    work (a data loader, a second process, ``torch.set_num_threads(1)`` in a
    worker) was left, and every thread then waits on the slowest one.
    """
    import torch

    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def dynamic(fn, *args):
    """Run a parallel kernel on :func:`kernel_threads` threads, handing out its B*H sequences one at a time
    (numba's parallel chunk size 1) instead of in equal static blocks, so a thread slowed by a busy core
    takes fewer. numba's thread count and chunk size are per calling thread; both are restored after."""
    old_threads = numba.get_num_threads()
    numba.set_num_threads(kernel_threads())
    old = numba.set_parallel_chunksize(1)
    try:
        return fn(*args)
    finally:
        numba.set_parallel_chunksize(old)
        numba.set_num_threads(old_threads)


def arr(x: Tensor) -> np.ndarray:
    """A contiguous NumPy view of a CPU tensor (a copy only when it is not contiguous)."""
    return x.detach().contiguous().numpy()


def check_float(*xs: np.ndarray) -> None:
    """ValueError unless every array is float32 or float64, all of one dtype."""
    if any(x.dtype != xs[0].dtype for x in xs) or xs[0].dtype not in (np.float32, np.float64):
        raise ValueError(f"numba kernels: inputs must share dtype float32 or float64; got {[str(x.dtype) for x in xs]}")
