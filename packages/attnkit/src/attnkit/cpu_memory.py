"""Fewer page faults in CPU training: keep freed memory in the process for the next step (Linux, glibc).

A training step on the CPU allocates its large intermediates afresh every time (torch has no caching
allocator on the CPU). glibc's ``malloc`` serves every block of 32 MiB or more with a fresh ``mmap`` and
returns it with ``munmap`` when it is freed, so the next step faults the same amount in again, 4 KiB at a
time, and the kernel zeroes every page. At L = 16,384 (B = 1, H = 8, D = 64, float32, two threads) that
was 334 MiB of first touches per ``sinkhorn`` training step and 328 MiB per ``lsh`` step, 14-27% of the
step's CPU time in the kernel (docs/benchmarks.md, "Session 43").

:func:`keep_freed_memory` asks glibc (``mallopt``) to serve large blocks from the heap and to keep freed
memory there instead of handing it back: the next step reuses the same pages without faults. Measured
there, in separate processes alternated: ``sinkhorn`` 684-697 -> 500-557 ms per step, ``lsh`` 1,084-1,265
-> 942-960 ms, ``local`` 505-527 -> 440-456 ms.

The setting is process-wide and applies to allocations made after the call; nothing in attnkit calls it
for you. The cost: the process keeps up to ``retain_mib`` of freed memory (its resident size stays near its
peak), and a block freed in the middle of the heap can only be reused, not returned. The same through the
environment, before the process starts: ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<bytes>``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

from .errors import InvalidInputError

__all__ = ["keep_freed_memory", "keeps_freed_memory"]

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4

#: mallopt takes an int: the largest retention it can express, in MiB
MAX_RETAIN_MIB = (2**31 - 1) >> 20

#: whether :func:`keep_freed_memory` took its settings in this process
_kept = False


def keeps_freed_memory() -> bool:
    """Whether this process serves large blocks from glibc's heap: :func:`keep_freed_memory` took its settings,
    or the process started with ``MALLOC_MMAP_MAX_=0``. Kernels read it to decide whether a large buffer kept
    for the backward is cheap: there a step reuses the previous step's pages; under glibc's default every block
    of 32 MiB or more is a fresh ``mmap`` whose pages are faulted in again on each step."""
    return _kept or os.environ.get("MALLOC_MMAP_MAX_") == "0"


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory(retain_mib: int = MAX_RETAIN_MIB, *, top_pad_mib: int = 64) -> bool:
    """Make glibc's ``malloc`` keep freed memory for reuse instead of returning it to the OS (process-wide).

    Large blocks then come from the heap rather than from a fresh ``mmap`` each, and freed memory at the top
    of the heap is kept up to ``retain_mib``, so a training loop reuses its pages from one step to the next
    instead of faulting them in (and having the kernel zero them) again. Call it once, early (before the
    training loop); it affects allocations made afterwards, by torch and by everything else in the process.

    Args:
        retain_mib: how much freed memory at the top of the heap the process keeps rather than returns
            (``M_TRIM_THRESHOLD``), in MiB: 1 to :data:`MAX_RETAIN_MIB` (2047, mallopt's limit).
        top_pad_mib: extra memory requested each time the heap grows (``M_TOP_PAD``), in MiB, 0 or more:
            fewer, larger ``brk`` calls.

    Returns:
        True when glibc took the settings; False where there is no glibc (macOS, Windows, musl: nothing is
        changed) or it refused one (the settings before it stay; the large blocks keep coming from ``mmap``).

    Raises:
        InvalidInputError: ``retain_mib`` outside 1..2047 or ``top_pad_mib`` negative or above 2047, or either
            not an int.
    """
    for name, value, low in (("retain_mib", retain_mib, 1), ("top_pad_mib", top_pad_mib, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_RETAIN_MIB:
            raise InvalidInputError(f"{name}: expected an int from {low} to {MAX_RETAIN_MIB} (MiB; mallopt takes "
                                    f"an int), got {value!r}")
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    ok = libc.mallopt(_M_TRIM_THRESHOLD, min(retain_mib << 20, 2**31 - 1)) == 1
    ok = ok and libc.mallopt(_M_TOP_PAD, top_pad_mib << 20) == 1
    # last: with the two above refused, large blocks keep coming from mmap and nothing is retained
    ok = ok and libc.mallopt(_M_MMAP_MAX, 0) == 1
    global _kept
    _kept = _kept or ok
    return ok
