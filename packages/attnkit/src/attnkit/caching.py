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

Under a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``) every tensor made is the transform's wrapper,
which outlives it without storage: kept in a cache, it fails a later call that reads its memory (numba kernels,
``torch.export.save``: "Cannot access storage of TensorWrapper"). Store an entry only when :func:`may_keep`
says so; a build under a transform serves that call alone.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["kept_tensors", "outside_trace", "reads_traced", "may_keep"]


def may_keep() -> bool:
    """False while a ``torch.func`` transform runs the current call: tensors made now are its wrappers, not to
    be kept between calls (a cache built then serves this call only; one built outside is read as usual)::

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
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def reads_traced(*reads: Any) -> bool:
    """True when a traced (fake) tensor is among ``reads``, searched through tensors, containers, the attributes
    of plain and slotted objects (masks, positions) and the closures of functions (a mask function's captured
    tensors).
    False at once when no fake-tensor trace is active."""
    if not _fake_mode_active():
        return False
    from torch._subclasses.fake_tensor import is_fake

    seen: set[int] = set()
    todo = list(reads)
    while todo:
        o = todo.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool, type, types.ModuleType)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if is_fake(o):
                return True
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
    return False


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
