"""Output buffers of CPU kernels reused from one call to the next: no fresh pages faulted in on every step.

The numba kernels allocate their outputs with NumPy and hand them to torch (``torch.from_numpy``). An array of
4 MiB or more is fresh memory on every call under glibc's defaults (large blocks come from ``mmap`` and go back
on ``free``), and NumPy asks for 2 MiB huge pages there, each zeroed by the kernel on its first touch. A causal
``performer`` training step at L = 8,192 (H = 8, M = 256) allocates about 220 MiB of kernel outputs (features,
denominators, gradients); measured on a 2-vCPU VM beside a ``scaled_dot_product_attention`` training step in the
same loop (which leaves the heap fragmented), the step took 196-914 ms (median 302) with fresh arrays and 171-229
ms (median 175) with these buffers (docs/benchmarks.md, "Session 62").

:func:`empty` hands out an uninitialised array whose memory is a buffer of the same size that nothing refers to
any more (no array, view or tensor made from it is alive), or a new one. The pool holds at most :func:`limit`
bytes, buffers in use and free together (``ATTNKIT_CPU_BUFFERS_MIB`` in the environment, MiB, default 1,024;
0 turns the pool off); to make room it drops the least recently used free buffers first, and a request that
still does not fit gets a plain ``np.empty``. :func:`release` drops every free buffer. Process-wide settings
are left alone (compare :func:`attnkit.cpu_memory.keep_freed_memory`, which changes glibc's for every
allocation).

Whether a buffer is free is read from its reference count: every NumPy view of it refers to the buffer itself
(NumPy points a view of a view at the array that owns the memory), and a tensor from ``torch.from_numpy`` holds
the array it was made from, so the pool's own reference is the only one left exactly when nothing can read or
write the memory. That is CPython's reference counting, which numba requires anyway.

Needs NumPy, which the core does not depend on: the plugins whose numba kernels use this module bring it (numba
requires it); ``import attnkit`` does not import this module. Tested in the kernelized plugin
(``plugins/attnkit-kernelized/tests/test_cpu_buffers.py``).
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from .errors import InvalidInputError

__all__ = ["empty", "limit", "set_limit", "release", "pooled_bytes", "MIN_BYTES"]

#: requests smaller than this get a plain ``np.empty`` (NumPy asks for huge pages from 4 MiB on)
MIN_BYTES = 4 << 20

_lock = threading.Lock()
_pool: list[np.ndarray] = []        # raw uint8 buffers, the least recently handed out first


def _limit_from_env() -> int:
    raw = os.environ.get("ATTNKIT_CPU_BUFFERS_MIB", "1024")
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if mib < 0:
        raise InvalidInputError(f"ATTNKIT_CPU_BUFFERS_MIB: expected a whole number of MiB >= 0 (0 turns the pool "
                                f"off), got {raw!r}")
    return mib << 20


_limit = _limit_from_env()


def limit() -> int:
    """The most bytes the pool holds (in use and free together); 0: no pool."""
    return _limit


def set_limit(mib: int) -> None:
    """Set :func:`limit` to ``mib`` MiB (0 turns the pool off); free buffers beyond it are dropped at once.

    Raises:
        InvalidInputError: ``mib`` not an int >= 0.
    """
    global _limit
    if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
        raise InvalidInputError(f"mib: expected an int >= 0 (MiB; 0 turns the pool off), got {mib!r}")
    with _lock:
        _limit = mib << 20
        _make_room(0)


def pooled_bytes() -> int:
    """Bytes the pool holds now, buffers in use and free together."""
    with _lock:
        return sum(b.nbytes for b in _pool)


def release() -> int:
    """Drop every free buffer (their memory goes back to the allocator); returns the bytes dropped."""
    with _lock:
        dropped, i = 0, 0
        while i < len(_pool):
            if _is_free_at(i):
                dropped += _pool.pop(i).nbytes
            else:
                i += 1
        return dropped


def _is_free_at(i: int) -> bool:
    # two references: the pool's list and getrefcount's argument (a view, an array or tensor made from it: more)
    return sys.getrefcount(_pool[i]) == 2


def _make_room(n: int) -> bool:
    """Drop least recently used free buffers until ``n`` more bytes fit under the limit; whether they fit."""
    total = sum(b.nbytes for b in _pool)
    i = 0
    while total + n > _limit and i < len(_pool):
        if _is_free_at(i):
            total -= _pool.pop(i).nbytes
        else:
            i += 1
    return total + n <= _limit


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype``, its memory from the pool when it is
    :data:`MIN_BYTES` or more (see the module's docstring), else from ``np.empty``."""
    dt = np.dtype(dtype)
    n = dt.itemsize
    for s in shape:
        n *= int(s)
    if n < MIN_BYTES or _limit == 0:
        return np.empty(shape, dtype=dt)
    with _lock:
        for i in range(len(_pool)):
            if _pool[i].nbytes == n and _is_free_at(i):
                buf = _pool.pop(i)
                _pool.append(buf)
                return buf.view(dt).reshape(shape)
        if not _make_room(n):
            return np.empty(shape, dtype=dt)
        buf = np.empty(n, dtype=np.uint8)
        _pool.append(buf)
        return buf.view(dt).reshape(shape)
