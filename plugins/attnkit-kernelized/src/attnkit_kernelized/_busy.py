"""Busy-machine mode: when other processes keep the cores busy, a CPU call runs torch's operations on one thread.

Measured on a 2-core machine beside a process keeping both cores busy (``docs/mechanisms/linear.md``,
"CPU threads and a busy machine"): a causal call is many short parallel regions (the feature maps, copies,
the backward's elementwise operations, one kernel per segment), and each one hands work to torch's
OpenMP threads and waits for all of them at its end. When another process holds the cores, every such
hand-over waits for a descheduled thread to get a core back, milliseconds each, and the call slowed
5-15x where SDPA (one long region) slowed 2x. On one thread those operations have no hand-over.

So a CPU call first asks :func:`machine_busy` whether other processes used enough CPU that this
process's threads cannot all have a core (``foreign + threads > cores + margin``, ``foreign`` being the
cores other processes used, averaged since the last sample). If so, torch runs on one thread for the
call (``torch.set_num_threads(1)``, restored after; with OpenMP builds this setting belongs to the
calling thread); the numba kernels keep the thread count torch had
(:func:`kernel_thread_count`), because they hand ranges of their sequences out one at a time
(:func:`attnkit.numba_pool.run_ranges`), which a descheduled thread does not hold up.

The decision costs one read of ``/proc/stat`` per :data:`WINDOW` seconds (cached in between) and
never changes a result: the same operations run, on fewer threads. ``ATTNKIT_KERNELIZED_BUSY=off``
in the environment turns it off; where ``/proc/stat`` is missing or torch does not use OpenMP it
never engages.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["machine_busy", "LoadSampler", "busy_threads", "kernel_thread_count", "WINDOW", "MARGIN"]

#: seconds between two samples of the machine's load (a decision is reused in between)
WINDOW = 0.1
#: cores of slack: busy only when ``foreign + threads > cores + MARGIN`` (the sampling is in 10 ms ticks)
MARGIN = 0.5


def machine_busy(foreign: float, threads: int, cores: int, margin: float = MARGIN) -> bool:
    """True when ``threads`` of this process plus ``foreign`` cores' worth of other processes' work exceed
    ``cores`` by more than ``margin``: some of this process's threads must then wait for a core."""
    return threads > 1 and foreign + threads > cores + margin


def _read_busy_seconds() -> float | None:
    """CPU seconds every process has used since boot (``/proc/stat``: all but idle and iowait), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICKS


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


try:
    _TICKS = os.sysconf("SC_CLK_TCK")
except (AttributeError, OSError, ValueError):  # pragma: no cover - non-POSIX
    _TICKS = 100


class LoadSampler:
    """The cores other processes used, averaged over the time since the previous sample.

    ``foreign = (CPU seconds of all processes - CPU seconds of this one) / wall seconds``, sampled at most
    every :data:`WINDOW` seconds; :meth:`busy` reuses the last decision in between. The readers are
    arguments so tests can inject a load.
    """

    def __init__(self, read_busy: Callable[[], float | None] = _read_busy_seconds,
                 read_own: Callable[[], float] = _own_seconds, clock: Callable[[], float] = time.monotonic,
                 cores: int | None = None, window: float = WINDOW) -> None:
        self.read_busy, self.read_own, self.clock, self.window = read_busy, read_own, clock, window
        self.cores = cores if cores is not None else (os.cpu_count() or 1)
        self.last: tuple[float, float, float] | None = None
        self.foreign = 0.0
        self.lock = threading.Lock()

    def sample(self) -> float:
        """The foreign load (cores) of the latest full window (0 until one has passed)."""
        with self.lock:
            now = self.clock()
            if self.last is not None and now - self.last[0] < self.window:
                return self.foreign
            busy = self.read_busy()
            if busy is None:
                return self.foreign
            own = self.read_own()
            if self.last is not None:
                t0, b0, o0 = self.last
                self.foreign = max(0.0, (busy - b0) - (own - o0)) / (now - t0)
            self.last = (now, busy, own)
            return self.foreign

    def busy(self, threads: int) -> bool:
        return machine_busy(self.sample(), threads, self.cores)


_ENABLED = os.environ.get("ATTNKIT_KERNELIZED_BUSY", "on").lower() not in ("0", "off", "false", "no")
_OPENMP = "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]
_sampler = LoadSampler()
_local = threading.local()


def kernel_thread_count() -> int | None:
    """Inside :func:`busy_threads` that engaged: the thread count torch had before (the numba kernels use it);
    else None (the kernels follow ``torch.get_num_threads()``)."""
    return getattr(_local, "threads", None)


@contextmanager
def busy_threads(device: torch.device | str, sampler: LoadSampler | None = None) -> Iterator[bool]:
    """For a CPU call: torch on one thread while the machine is busy (:class:`LoadSampler`), restored after.

    Yields whether it engaged. Nested uses (the backward inside a forward, a segment inside a call) reuse
    the outer decision; under ``torch.compile`` tracing it never engages.
    """
    # not while torch.compile traces (thread counts are not graph operations): the compiled call keeps torch's
    if (torch.compiler.is_compiling() or torch.device(device).type != "cpu" or not _ENABLED or not _OPENMP
            or getattr(_local, "threads", None) is not None):
        yield False
        return
    threads = torch.get_num_threads()
    if not (sampler or _sampler).busy(threads):
        yield False
        return
    _local.threads = threads
    torch.set_num_threads(1)
    try:
        yield True
    finally:
        torch.set_num_threads(threads)
        _local.threads = None
