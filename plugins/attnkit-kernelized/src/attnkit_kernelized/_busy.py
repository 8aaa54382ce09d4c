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

The same holds for the call's backward, which autograd runs after the call has returned: the backward of
the copies, the segments' split (a ``cat`` of their gradients), the state's scaling and the features are
short regions too (measured at L = 8,192 beside the same load: performer's training step 0.84-0.86 s with
only the kernels' own backward in the mode, 0.69-0.75 s with the call's whole backward; 0.32-0.34 s idle
either way). :func:`backward_span` marks a call's differentiable inputs and :func:`start_backward_span` its
outputs: when autograd reaches the outputs' nodes the machine is sampled again, and if it is busy torch runs
on one thread until the inputs' gradients are complete (or the backward pass ends), then gets its count
back.

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

from attnkit import transforms
from attnkit.caching import tensors_in

__all__ = ["machine_busy", "LoadSampler", "busy_threads", "kernel_thread_count", "backward_span",
           "start_backward_span", "WINDOW", "MARGIN"]

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
            or getattr(_local, "threads", None) is not None and not _end_stale_span()):
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


# ------------------------------------------------------------------ a call's backward
class _Span:
    """One call's backward: the thread count to give back once engaged (None: not engaged)."""

    __slots__ = ("threads",)

    def __init__(self) -> None:
        self.threads: int | None = None


def _end_span(span: _Span) -> None:
    """Give torch its thread count back if ``span`` is the engaged one (idempotent)."""
    if getattr(_local, "span", None) is span and span.threads is not None:
        torch.set_num_threads(span.threads)
        span.threads = None
        _local.span = None
        _local.threads = None


def _end_stale_span() -> bool:
    """End a span a backward pass left engaged because it raised (its end never ran), when no backward pass is
    running on this thread; True if one was ended."""
    span = getattr(_local, "span", None)
    if span is None or torch._C._current_graph_task_id() != -1:
        return False
    _end_span(span)
    return True


def _start_span(span: _Span) -> None:
    """Autograd reached the call's outputs: on a busy machine torch runs on one thread from here until
    :class:`_SpanEnd` (the inputs' gradients complete) or the end of this backward pass, whichever is first."""
    if getattr(_local, "threads", None) is not None:     # inside another call's span (or a forward's mode)
        return
    threads = torch.get_num_threads()
    if not _sampler.busy(threads):
        return
    span.threads = threads
    _local.span = span
    _local.threads = threads
    torch.set_num_threads(1)
    # also when the inputs' node never runs (a backward pass that needs none of their gradients)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_span(span))


class _SpanEnd(torch.autograd.Function):
    """Identity on a call's differentiable inputs; its backward, reached when their gradients are complete
    (every node of the call has run), ends the span."""

    @staticmethod
    def forward(span: _Span, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.span = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        _end_span(ctx.span)
        return (None, *grads)


def backward_span(*tensors: torch.Tensor | None) -> tuple[tuple[torch.Tensor | None, ...], _Span | None]:
    """Mark a CPU call's inputs so that its backward can run in busy-machine mode: ``(tensors, span)``.

    The tensors that need a gradient come back as views through one autograd node that ends the span (use
    them inside the call only: a view made by a custom autograd function cannot be modified in place), the
    others as they were; pass ``span`` and the call's result to :func:`start_backward_span`. ``span`` is None
    (and the tensors unchanged) when the mode cannot apply: no gradient needed, a tensor not on the CPU,
    ``torch.compile`` or ``torch.export`` tracing, a ``torch.func`` transform or a call on dual tensors of
    ``torch.autograd.forward_ad`` (:func:`attnkit.transforms.active`), the mode turned off.
    """
    # (a call on dual tensors of torch.autograd.forward_ad reports "jvp" in transforms.active(): the core runs it
    # as under torch.func.jvp, and the identity node, a custom function without a forward-mode rule, stays out)
    if (not _ENABLED or not _OPENMP or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or transforms.active()):
        return tensors, None
    grad = [t is not None and t.requires_grad for t in tensors]
    if not any(grad) or any(t is not None and t.device.type != "cpu" for t in tensors):
        return tensors, None
    span = _Span()
    views = iter(_SpanEnd.apply(span, *(t for t, g in zip(tensors, grad) if g)))
    return tuple(next(views) if g else t for t, g in zip(tensors, grad)), span


def start_backward_span(span: _Span | None, result: object) -> None:
    """Start ``span`` (from :func:`backward_span`) when autograd reaches the node of a tensor of ``result`` (found
    as :func:`attnkit.caching.tensors_in` finds them: tuples, dicts of a state): a hook on those nodes, nothing on
    the tensors themselves."""
    if span is None:
        return
    nodes = {id(t.grad_fn): t.grad_fn for t in tensors_in(result) if t.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(lambda grads: _start_span(span))
