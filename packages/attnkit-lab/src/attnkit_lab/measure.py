"""Timing and peak-memory measurement of one callable.

Time: ``time.perf_counter`` around the call, with ``torch.cuda.synchronize``
before and after on CUDA.

Peak memory, the bytes a call allocates on top of what was live before it:

- CUDA: ``torch.cuda.max_memory_allocated()`` after
  ``reset_peak_memory_stats()``, minus ``memory_allocated()`` before.
- CPU: PyTorch's own allocator has no peak counter, and process RSS is
  blurred by the C allocator's caching. We run the call once under
  ``torch.profiler`` with ``profile_memory=True`` and replay its allocation
  and free events in time order; the peak of the running sum is the result.
  This counts every tensor allocated through PyTorch's CPU allocator during
  the call (outputs, saved activations, gradients, temporaries). It does not
  count memory a kernel allocates outside PyTorch (e.g. NumPy arrays inside
  a numba kernel), nor the inputs, which exist before the call. The
  profiled run is separate from the timed runs, so its overhead never
  enters a timing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device | str) -> float:
    """Seconds one call of ``fn`` takes (device work included)."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Silence C-level stderr (kineto prints a banner on profiler start/stop)."""
    try:
        fd: int | None = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # captured (pytest, notebooks): nothing to silence
        fd = None
    if fd is None:
        # yield outside the except block: an exception thrown in here (Ctrl-C) must not get the
        # handled error as its __context__, which would hide the KeyboardInterrupt numba chains
        yield
        return
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _cpu_peak(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # kineto prints a banner on start/stop and the allocator warns about blocks
    # allocated before profiling; both go to the C-level stderr, silenced here.
    # Python exceptions still propagate.
    with _quiet_stderr_fd():
        prof.__enter__()
        try:
            fn()
        finally:
            prof.__exit__(None, None, None)
    events = []
    for e in prof.profiler.kineto_results.events():
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            events.append((e.start_ns(), e.nbytes()))
    events.sort()
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return int(peak)


def peak_memory(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes allocated by one call of ``fn`` above what was live before it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    if device.type == "cpu":
        return _cpu_peak(fn)
    raise ValueError(f"peak_memory: unsupported device {device}")


MEMORY_METHOD = {
    "cpu": "torch.profiler allocation events (PyTorch CPU allocator), peak of the running sum above the inputs",
    "cuda": "torch.cuda.max_memory_allocated above memory_allocated before the call",
}
