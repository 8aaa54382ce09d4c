"""Tensors an implementation keeps between calls: plans, block indices, tables, workspaces.

A tensor made under :func:`torch.inference_mode` is an *inference tensor*: autograd
refuses to save it for a backward pass and it cannot be updated in place outside
inference mode. A cache filled during a validation pass under ``inference_mode``
would then break the next training step (``Inference tensors cannot be saved for
backward``). Build anything kept between calls inside :func:`kept_tensors`.

While :func:`torch.export.export` (non-strict, its default) or ``make_fx`` traces a call, every tensor
made is a *fake* tensor: a cache filled then would hold tensors without data, and a build that reads
tensor values (``nonzero``, ``int(t.max())``: block plans) fails there ("Could not extract specialized
integer from data-dependent expression"). A build that depends only on shapes and options runs inside
:func:`outside_trace` on real tensors; the trace then records its result as a constant.

Under a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``) every tensor made from its inputs (``q * 2``,
``q.new_ones(n)``, ``torch.ones_like(q)``) is the transform's wrapper, which outlives it without storage: kept in
a cache, it fails a later call that reads its memory (numba kernels, ``torch.export.save``: "Cannot access
storage of TensorWrapper"). Store an entry only when :func:`may_keep` says so; a build under a transform serves
that call alone.

:func:`cached` does all three for a dict-like cache: look up, build on real ordinary tensors, keep when allowed.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Any, TypeVar

import torch

__all__ = ["cached", "kept_tensors", "outside_trace", "reads_traced", "may_keep", "tensors_in"]

T = TypeVar("T")


def cached(cache: MutableMapping[Any, T], key: Hashable | None, build: Callable[[], T], *reads: Any,
           limit: int | None = None) -> T:
    """``cache[key]``, or ``build()`` made the way a kept entry must be and stored when it may be kept.

    On a miss ``build()`` runs inside :func:`outside_trace` (``reads``: what it reads, as there) and
    :func:`kept_tensors`; its result is stored unless ``key`` is None (an entry that is never kept: one for
    explicit position tensors) or :func:`may_keep` is False (a ``torch.func`` transform runs the call: the
    result serves this call alone). A stored entry is never None.

    Args:
        cache: a dict (or other mutable mapping) of kept entries.
        key: the entry's key, or None to build without storing.
        build: makes the entry; called with no arguments, only on a miss.
        reads: what the build reads (masks, positions, tensors), for :func:`outside_trace`.
        limit: when the cache already holds more than ``limit`` entries, it is cleared before the new one is
            stored (a bound on what a process keeps; None: unbounded).

    Example::

        plan = attnkit.caching.cached(self._plans, (L, block, str(device)),
                                      lambda: build_plan(L, block, device), limit=8)
    """
    if key is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    with outside_trace(*reads), kept_tensors():
        built = build()
    if key is not None and may_keep():
        if limit is not None and len(cache) > limit:
            cache.clear()
        cache[key] = built
    return built


def may_keep() -> bool:
    """False while a ``torch.func`` transform runs the current call: tensors made from its inputs are its wrappers, not
    to be kept between calls (a cache built then serves this call only; one built outside is read as usual)::

        entry = cache.get(key)
        if entry is None:
            with attnkit.caching.kept_tensors():
                entry = build_plan(...)
            if attnkit.caching.may_keep():
                cache[key] = entry
    """
    return torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None


@contextlib.contextmanager
def kept_tensors() -> Iterator[None]:
    """Make the tensors created inside ordinary tensors, even when the caller runs under ``inference_mode``.

    Under :func:`torch.inference_mode` it leaves inference mode (with gradients still off); otherwise, and
    while ``torch.compile`` traces, it changes nothing. Use it around building a cache entry or a reused buffer::

        with attnkit.caching.kept_tensors():
            cache[key] = build_plan(...)
    """
    # torch.compile cannot trace is_inference_mode_enabled (a graph break); a compiled graph keeps no cache
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            yield
    else:
        yield


def _fake_mode_active() -> bool:
    # while Dynamo traces (torch.compile) no fake-tensor trace of ours is active, and the dispatch-mode query is not
    # something it can trace (a graph break at every cache look-up)
    if torch.compiler.is_dynamo_compiling():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def reads_traced(*reads: Any) -> bool:
    """True when a traced (fake) tensor is among ``reads``, searched through tensors, containers, the attributes
    of plain and slotted objects (masks, positions) and the closures of functions (a mask function's captured
    tensors) (:func:`tensors_in`).
    False at once when no fake-tensor trace is active."""
    if not _fake_mode_active():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(t) for t in tensors_in(*reads))


def tensors_in(*reads: Any) -> Iterator[torch.Tensor]:
    """Every tensor among ``reads``, searched through containers, the attributes of plain and slotted objects
    (masks, positions) and the closures of functions (a mask function's captured tensors); each object once."""
    seen: set[int] = set()
    todo = list(reads)
    while todo:
        o = todo.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool, type, types.ModuleType)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo.extend(o)
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, types.FunctionType):
            for cell in o.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:   # an empty cell (a variable the function closes over, not yet bound)
                    pass
        elif isinstance(o, types.MethodType):
            todo.append(o.__self__)
        else:
            if hasattr(o, "__dict__"):
                todo.extend(vars(o).values())
            for cls in type(o).__mro__:   # slotted objects (attnkit.Positions)
                todo.extend(getattr(o, s) for s in getattr(cls, "__slots__", ()) if hasattr(o, s))


@contextlib.contextmanager
def outside_trace(*reads: Any) -> Iterator[bool]:
    """Run a cache build on real tensors while ``torch.export`` (non-strict) or ``make_fx`` traces.

    Yields True when it left a trace. ``reads``: what the build reads (masks, positions, tensors); when one of
    them holds a traced tensor (an input of the traced call: a key padding mask, explicit positions), the build
    stays in the trace, where reading tensor values fails as it would without this. Outside a fake-tensor
    trace, and while ``torch.compile``'s Dynamo traces (it runs such builds in eager code at a graph break),
    it changes nothing::

        with attnkit.caching.outside_trace(mask), attnkit.caching.kept_tensors():
            cache[key] = build_plan(mask, ...)
    """
    if torch.compiler.is_dynamo_compiling() or not _fake_mode_active() or reads_traced(*reads):
        yield False
        return
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield True
