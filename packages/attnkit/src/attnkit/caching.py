"""Tensors an implementation keeps between calls: plans, block indices, tables, workspaces.

A tensor made under :func:`torch.inference_mode` is an *inference tensor*: autograd
refuses to save it for a backward pass and it cannot be updated in place outside
inference mode. A cache filled during a validation pass under ``inference_mode``
would then break the next training step (``Inference tensors cannot be saved for
backward``). Build anything kept between calls inside :func:`kept_tensors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["kept_tensors"]


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
