"""What the numba kernels share: the thread pool, dynamic scheduling, fastmath flags, array views.

Importing this module imports numba and starts its thread pool; only the
``numba_ops`` modules import it, on the first use of the numba backend.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from attnkit.numba_pool import kernel_threads, run_items, run_parallel, start_pool

from ._busy import kernel_thread_count

__all__ = ["FASTMATH", "kernel_threads", "threads", "dynamic", "rows", "arr", "check_float", "output"]


start_pool()   # keeps torch's thread count (launching numba's OpenMP pool reset it; attnkit.numba_pool)

# reassociation lets LLVM vectorise the short reductions; no NaN/inf
# assumptions, so zeros from masked positions and NaN inputs behave exactly
FASTMATH = {"reassoc", "contract", "nsz"}


def output(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array for a kernel's output, to hand to torch with ``torch.from_numpy``.

    Allocated by NumPy, not ``torch.empty``: on Linux NumPy asks the kernel for transparent huge pages
    (``madvise``) for 4 MiB and more, torch only under ``THP_MEM_ALLOC_ENABLE=1``. An output of 32 MiB or more
    comes from a fresh ``mmap`` on every call (glibc), and its first touch faulted 8,192 4-KiB pages: linear's
    fused forward at L = 16,384 (H = 8, D = 64, float32, 2 threads) took 44 ms with a torch output and 34 ms with
    this one (528 faults; session 37, docs/benchmarks.md)."""
    return np.empty(shape, dtype=dtype)


def threads() -> int:
    """Threads a kernel call uses: :func:`kernel_threads`, or inside a call that runs torch on one thread
    because the machine is busy (:func:`attnkit_kernelized._busy.busy_threads`), the count torch had before."""
    saved = kernel_thread_count()
    return kernel_threads() if saved is None else _cap(saved)


def _cap(n: int) -> int:
    import numba

    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


def dynamic(fn, *args):
    """Run a parallel kernel on :func:`threads` threads, numba's parallel chunk size 1
    (:func:`attnkit.numba_pool.run_parallel`; numba's OpenMP layer still splits the sequences statically)."""
    return run_parallel(fn, *args, threads=threads())


def rows(kernel, n: int, *args) -> None:
    """Run a serial ``nogil`` kernel ``kernel(*args, n0, n1)`` (sequences ``n0 <= i < n1`` of ``n``) on
    :func:`threads` threads, handing out blocks of sequences one at a time
    (:func:`attnkit.numba_pool.run_items`): a thread the operating system deschedules takes fewer
    blocks, and the others never wait for a share it holds. Each sequence is computed by one thread with
    the same code, so the result does not depend on the thread count or the order."""
    t = threads()
    per = max(1, n // (4 * t))                    # at least ~4 blocks per thread; one sequence when n is small
    blocks = -(-n // per)
    run_items(lambda b: kernel(*args, b * per, min(n, (b + 1) * per)), blocks, threads=t)


def arr(x: Tensor) -> np.ndarray:
    """A contiguous NumPy view of a CPU tensor (a copy only when it is not contiguous)."""
    return x.detach().contiguous().numpy()


def check_float(*xs: np.ndarray) -> None:
    """ValueError unless every array is float32 or float64, all of one dtype."""
    if any(x.dtype != xs[0].dtype for x in xs) or xs[0].dtype not in (np.float32, np.float64):
        raise ValueError(f"numba kernels: inputs must share dtype float32 or float64; got {[str(x.dtype) for x in xs]}")
