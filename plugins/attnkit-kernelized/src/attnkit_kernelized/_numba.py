"""What the numba kernels share: running a serial kernel over ranges of sequences on threads, fastmath flags,
array views.

Every kernel of the plugin is a serial ``nogil`` build that computes the work items ``i0 <= i < i1`` (sequences of
the B*H, or blocks of elements) into outputs its caller allocated; :func:`rows` hands ranges of them to a team of
torch's OpenMP pool (:func:`attnkit.numba_pool.run_ranges`). A serial build compiles in about a third of the time
of a ``parallel=True`` one (numba's parfor passes), and torch's own threads do the work instead of a second pool
beside them (docs/benchmarks.md, "CI time, session 41"). Only the ``numba_ops`` modules import this module, on
the first use of the numba backend.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from attnkit import cpu_buffers
from attnkit.numba_pool import kernel_threads, run_ranges

from ._busy import kernel_thread_count

__all__ = ["FASTMATH", "kernel_threads", "threads", "rows", "arr", "check_float", "output", "pad_rows"]

# reassociation lets LLVM vectorise the short reductions; no NaN/inf
# assumptions, so zeros from masked positions and NaN inputs behave exactly
FASTMATH = {"reassoc", "contract", "nsz"}


def output(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array for a kernel's output, to hand to torch with ``torch.from_numpy``.

    From :func:`attnkit.cpu_buffers.empty`: 4 MiB and more reuse a buffer of an earlier call that nothing refers
    to any more (a training step's features, denominators and gradients come back every step; fresh ones were
    faulted in again each time, session 62), else NumPy's memory, not ``torch.empty``: on Linux NumPy asks the
    kernel for transparent huge pages (``madvise``) for 4 MiB and more, torch only under
    ``THP_MEM_ALLOC_ENABLE=1`` (linear's fused forward at L = 16,384: 44 ms with a torch output, 34 ms with a NumPy
    one; session 37, docs/benchmarks.md)."""
    return cpu_buffers.empty(shape, dtype)


def threads() -> int:
    """Threads a kernel call uses: :func:`kernel_threads`, or inside a call that runs torch on one thread
    because the machine is busy (:func:`attnkit_kernelized._busy.busy_threads`), the count torch had before."""
    saved = kernel_thread_count()
    return kernel_threads() if saved is None else _cap(saved)


def _cap(n: int) -> int:
    import numba

    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


def rows(kernel, n: int, *args, item: int = 1) -> None:
    """Run a serial ``nogil`` kernel ``kernel(*args, i0, i1)`` over ``n`` work items on :func:`threads` threads.

    The items (a sequence of the B*H each, or, with ``item > 1``, elements in blocks of ``item``: the kernel then
    gets element bounds ``i0 <= i < i1`` that are multiples of ``item`` but the last) are cut into about four
    contiguous ranges per thread and handed out one at a time (:func:`attnkit.numba_pool.run_ranges`): a thread
    the operating system deschedules takes fewer, and the others never wait for a share it holds. Each item is
    computed by one thread with the same code, so the result does not depend on the thread count or the order."""
    t = threads()
    if item == 1:
        run_ranges(kernel, n, *args, threads=t)
        return
    run_ranges(lambda *a: kernel(*a[:-2], a[-2] * item, min(n, a[-1] * item)), -(-n // item), *args, threads=t)


def arr(x: Tensor) -> np.ndarray:
    """A contiguous NumPy view of a CPU tensor (a copy only when it is not contiguous)."""
    return x.detach().contiguous().numpy()


def pad_rows(pad: Tensor | None, B: int, H: int, L: int) -> np.ndarray:
    """A key padding mask ``(B, 1, L, 1)`` bool as the kernels read it, one row per sequence: ``(B·H, L)``; None
    gives ``(B·H, 0)`` (nothing padded)."""
    if pad is None:
        return np.zeros((B * H, 0), dtype=np.bool_)
    return arr(pad[:, 0, :, 0].reshape(B, 1, L).expand(B, H, L).reshape(B * H, L))


def check_float(*xs: np.ndarray) -> None:
    """ValueError unless every array is float32 or float64, all of one dtype."""
    if any(x.dtype != xs[0].dtype for x in xs) or xs[0].dtype not in (np.float32, np.float64):
        raise ValueError(f"numba kernels: inputs must share dtype float32 or float64; got {[str(x.dtype) for x in xs]}")
