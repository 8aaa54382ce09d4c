"""The numba thread pool that plugins' CPU kernels share: started with passive idle threads, sized by torch.

numba is imported by these functions, never by ``import attnkit`` (the core does
not need it); a plugin's numba backend module calls :func:`start_pool` before it
compiles or loads its kernels and launches them with :func:`run_parallel`.

:func:`run_items` is the opt-in alternative for serial ``nogil`` kernels: the
items are handed out one at a time to the calling thread and a few Python
helper threads, so a thread the operating system deschedules (another process
on the cores) simply takes fewer items instead of holding a share the others
wait for (numba's OpenMP layer splits a ``prange`` statically among its threads).
:func:`run_ranges` hands out ranges of a serial kernel's work items the same way, on a team of torch's own
OpenMP pool where torch's libgomp is loaded (else on those Python threads): a serial build compiles in about a
third of the time of a ``parallel=True`` one (numba's parfor passes).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["start_pool", "kernel_threads", "run_parallel", "run_items", "run_ranges"]


def start_pool() -> None:
    """Start numba's thread pool with idle threads that sleep instead of spinning (idempotent).

    With the ``omp`` threading layer numba runs its own copy of libgomp next to
    the one bundled with torch; idle GNU OpenMP threads busy-wait by default,
    so after every kernel call numba's threads would spin on the cores torch's
    next operation needs (measured: SDPA and the feature maps ran ~2x slower
    on 2 cores). libgomp reads ``OMP_WAIT_POLICY`` when it is loaded, which
    happens when numba launches its threads, so it is set to ``PASSIVE`` for
    that moment only (unless the user set it) and restored afterwards.

    torch's thread count is kept: once torch's own OpenMP pool is up (any product ran), launching numba's
    reset it to the core count (``torch.set_num_threads(1)`` before the first numba call read 2 after it
    on a 2-core machine), and the kernels follow torch's count, so both would have run on every core.
    """
    import numba
    import torch

    key = "OMP_WAIT_POLICY"
    user_set = key in os.environ
    torch_threads = torch.get_num_threads()
    if not user_set:
        os.environ[key] = "PASSIVE"
    try:
        numba.get_num_threads()  # launches the pool (and loads numba's libgomp) once
    finally:
        if not user_set:
            os.environ.pop(key, None)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)


def kernel_threads() -> int:
    """Threads a kernel call uses: ``torch.get_num_threads()``, capped by the threads numba launched.

    numba's pool and torch's intra-op pool are separate; a kernel running on
    more threads than torch is told to use oversubscribes the cores other
    work (a data loader, a second process, ``torch.set_num_threads(1)`` in a
    worker) was left, and every thread then waits on the slowest one.
    """
    import numba

    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def run_parallel(kernel: Any, *args: Any, items: int | None = None, threads: int | None = None) -> Any:
    """Call a ``parallel=True`` kernel on :func:`kernel_threads` threads; numba's settings are restored after.

    Args:
        kernel: the compiled kernel.
        *args: its arguments.
        items: the kernel's ``prange`` work items. Given: one chunk of about ``items / threads`` per
            thread (numba's chunked scheduling costs about 1 ms per chunk: measured on the sparse
            engine, 16 chunks per thread made a 1K forward+backward 110 ms instead of 23 ms). None:
            chunk size 1, the items handed out one at a time, so a thread slowed by a busy core takes
            fewer (the kernelized family's few, long B·H sequences).
        threads: run on this many threads (capped by the threads numba launched) instead of
            :func:`kernel_threads` (None, the default).
    """
    import numba

    threads = kernel_threads() if threads is None else max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    old_threads = numba.get_num_threads()
    numba.set_num_threads(threads)
    old = numba.set_parallel_chunksize(1 if items is None else max(1, -(-items // threads)))
    try:
        return kernel(*args)
    finally:
        numba.set_parallel_chunksize(old)
        numba.set_num_threads(old_threads)


# ------------------------------------------------------------- items on Python threads
_helpers: ThreadPoolExecutor | None = None
_helpers_size = 0
_helpers_lock = threading.Lock()


def _helper_pool(size: int) -> ThreadPoolExecutor:
    """The shared helper threads of :func:`run_items` (created on first use, grown when more are asked for)."""
    global _helpers, _helpers_size
    with _helpers_lock:
        if _helpers is None or _helpers_size < size:
            old = _helpers
            _helpers = ThreadPoolExecutor(max_workers=size, thread_name_prefix="attnkit-items")
            _helpers_size = size
            if old is not None:
                old.shutdown(wait=False)
        return _helpers


class _Items:
    """One :func:`run_items` call: the next item to hand out, the items running, the first error."""

    def __init__(self, work: Callable[[int], Any], items: int) -> None:
        self.work, self.items = work, items
        self.next = 0
        self.active = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()

    def run(self) -> None:
        """Take items one at a time until none is left (or one failed)."""
        while True:
            with self.cond:
                if self.error is not None or self.next >= self.items:
                    return
                i = self.next
                self.next += 1
                self.active += 1
            try:
                self.work(i)
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                with self.cond:
                    if self.error is None:
                        self.error = e
            finally:
                with self.cond:
                    self.active -= 1
                    self.cond.notify_all()

    def wait(self) -> None:
        """Until every item handed out has finished; re-raises the first error."""
        with self.cond:
            while self.active:
                self.cond.wait()
        if self.error is not None:
            raise self.error


def run_items(work: Callable[[int], Any], items: int, *, threads: int | None = None, team: bool = False) -> None:
    """Call ``work(i)`` for every ``i`` in ``range(items)`` on ``threads`` threads, one item at a time.

    The calling thread works too, beside ``threads - 1`` other threads; each takes the next
    item when it finishes one, so a thread that the operating system deschedules (another process
    on the cores) takes fewer items and nobody waits for a fixed share it holds. The work must
    release the GIL (a ``nogil=True`` numba kernel) to run in parallel. Threads that start after
    the last item was handed out return at once, so a call made from inside ``work`` cannot deadlock.

    Args:
        work: called with the item index; what it returns is ignored (write results into arrays).
        items: how many items.
        threads: threads to use (None: :func:`kernel_threads`); at most ``items``; 1 runs every item in
            the calling thread.
        team: the other threads are a team of torch's OpenMP pool where there is one (:data:`KERNEL_TEAM`);
            False: shared Python helper threads.

    Raises:
        The first exception ``work`` raised (no further items are handed out after it).
    """
    threads = kernel_threads() if threads is None else threads
    threads = max(1, min(threads, items))
    if threads == 1:
        for i in range(items):
            work(i)
        return
    omp = _team() if team else None
    if omp is not None:
        _on_omp_team(work, items, threads, omp)
        return
    call = _Items(work, items)
    pool = _helper_pool(threads - 1)
    for _ in range(threads - 1):
        pool.submit(call.run)
    call.run()
    call.wait()


#: contiguous ranges of work items per thread that :func:`run_ranges` cuts a call into
RANGES_PER_THREAD = 4

#: which threads :func:`run_ranges` (and :func:`run_items` with ``team=True``) run on: ``"auto"`` (a team of
#: torch's OpenMP pool where torch's libgomp is loaded, else Python helper threads), ``"omp"`` or ``"python"``.
#: Set by the environment variable ``ATTNKIT_KERNEL_TEAM``. Why torch's team: after a torch operation ran on
#: torch's OpenMP pool, the pool's idle worker spins for a few milliseconds, and Python helper threads share the
#: cores with it (the sparse engine's 1K forward right after a matmul: 18-19 ms on helper threads, 13-14 ms on the
#: team; session 40, 2 cores).
KERNEL_TEAM = os.environ.get("ATTNKIT_KERNEL_TEAM", "auto")

_omp: Any = None            # (GOMP_parallel, its callback type) once looked up; False when there is none
_omp_lock = threading.Lock()


def _omp_parallel() -> Any:
    """torch's libgomp ``GOMP_parallel`` through ctypes (looked up once), or None (no libgomp of torch's loaded:
    another OS, a torch built with another thread pool). A team of torch's pool takes its spinning worker
    itself (see :data:`KERNEL_TEAM`), as numba's ``prange`` kernels apparently do (two busy threads with them,
    three with Python helper threads)."""
    global _omp
    with _omp_lock:
        if _omp is None:
            _omp = False
            try:
                import ctypes

                lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
                with open("/proc/self/maps", encoding="utf-8") as maps:
                    paths = {line.split()[-1] for line in maps if "libgomp" in line}
                ours = sorted(p for p in paths if p.startswith(lib_dir))
                if ours:
                    lib = ctypes.CDLL(ours[0])
                    callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
                    fn = lib.GOMP_parallel
                    fn.argtypes = [callback, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
                    fn.restype = None
                    _omp = (fn, callback)
            except (OSError, AttributeError):
                _omp = False
        return _omp or None


def _on_omp_team(work: Callable[[int], Any], items: int, threads: int, omp: Any) -> None:
    """:func:`run_items`'s hand-out (:class:`_Items`) on a team of ``threads`` threads of torch's OpenMP pool (the
    calling thread is one of them); ``GOMP_parallel`` returns when every team thread has, and the first error is
    re-raised in the caller."""
    fn, callback = omp
    call = _Items(work, items)
    fn(callback(lambda _data: call.run()), None, threads, 0)
    call.wait()


def run_ranges(kernel: Callable[..., Any], items: int, *args: Any, threads: int | None = None) -> None:
    """Call ``kernel(*args, i0, i1)`` over contiguous ranges ``[i0, i1)`` that cover ``range(items)``, on threads.

    For a serial ``nogil`` numba kernel whose loop runs over the work items ``i0 <= i < i1`` and writes its
    results into arrays among ``args`` (each item its own rows): a serial build compiles in about a third of the
    time of a ``parallel=True`` one (numba's parfor passes). The items are cut into about
    :data:`RANGES_PER_THREAD` ranges per thread, handed out one at a time (a thread slowed by another process
    takes fewer), to a team of torch's OpenMP pool where there is one (see :data:`KERNEL_TEAM`), else to
    :func:`run_items`'s Python threads; one thread makes a single call over every item.

    Args:
        kernel: called as ``kernel(*args, i0, i1)``; what it returns is ignored.
        items: how many work items (0: no call).
        *args: the kernel's leading arguments.
        threads: threads to use (None: :func:`kernel_threads`).

    Raises:
        The first exception a call of ``kernel`` raised (no further ranges are handed out after it).
    """
    threads = kernel_threads() if threads is None else max(1, threads)
    if items <= 0:
        return
    ranges = 1 if threads == 1 else min(items, threads * RANGES_PER_THREAD)
    if ranges == 1:
        kernel(*args, 0, items)
        return

    def work(r: int) -> None:
        kernel(*args, r * items // ranges, (r + 1) * items // ranges)

    run_items(work, ranges, threads=threads, team=True)


def _team() -> Any:
    """torch's ``GOMP_parallel`` per :data:`KERNEL_TEAM`, or None for Python helper threads."""
    if KERNEL_TEAM not in ("auto", "omp", "python"):
        raise ValueError(f"attnkit.numba_pool.KERNEL_TEAM (or ATTNKIT_KERNEL_TEAM): expected 'auto', 'omp' or "
                         f"'python', got {KERNEL_TEAM!r}")
    omp = _omp_parallel() if KERNEL_TEAM != "python" else None
    if KERNEL_TEAM == "omp" and omp is None:
        raise RuntimeError("attnkit.numba_pool.KERNEL_TEAM='omp': torch's libgomp is not loaded in this process "
                           "(torch built with another thread pool, or not Linux); use 'auto' or 'python'")
    return omp
