"""Launching a triton kernel with tiles that fit the GPU's shared memory.

A tile size chosen from the problem (a 256-feature performer's ``BLOCK_X = 256``
with 64-position chunks) can need more shared memory than the GPU has: on an
H100 the performer's and rfa's product kernels asked for 360 KB against 227 KB
and triton raised ``OutOfResources`` at their first launch. :func:`launch`
retries such a launch with a smaller configuration (first one software-pipeline
stage, then halved tiles, never below 16) and remembers the configuration that
compiled, so later calls start from it. Only tiles whose size does not change
the result's layout may be named as shrinkable (a chunk size that the backward
pass must match is not). Triton is imported by the callers; this module needs
none of it at import time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: (kernel name, requested configuration) -> the configuration that compiled
_FITTED: dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]] = {}

MIN_TILE = 16


def block(n: int, cap: int | None = None) -> int:
    """A tile for ``n`` elements: the next power of two, at least :data:`MIN_TILE` (``tl.dot``'s smallest), at most
    ``cap`` when given."""
    b = max(MIN_TILE, 1 << (max(n, 1) - 1).bit_length())
    return min(b, cap) if cap else b


def _is_out_of_resources(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfResources"


def smaller(meta: dict[str, Any], shrink: Sequence[str]) -> dict[str, Any] | None:
    """The next configuration to try after ``meta`` ran out of resources, or None when none is left:
    ``num_stages=1`` first, then the largest of the ``shrink`` tiles halved (not below :data:`MIN_TILE`)."""
    if meta.get("num_stages") != 1:
        return {**meta, "num_stages": 1}
    tiles = [name for name in shrink if meta.get(name, 0) > MIN_TILE]
    if not tiles:
        return None
    name = max(tiles, key=lambda t: meta[t])
    return {**meta, name: meta[name] // 2}


def launch(kernel: Any, grid: Callable[[dict[str, Any]], tuple[int, ...]], args: Sequence[Any],
           meta: dict[str, Any], shrink: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``kernel[grid(meta)](*args, **meta)``; on ``OutOfResources`` retry with :func:`smaller` configurations.

    Args:
        kernel: a ``triton.jit`` function.
        grid: the launch grid of a configuration (tiles change the number of programs).
        args: the positional arguments; the kernel must write every output whatever the tiles.
        meta: the requested constexprs and launch options (``num_warps``, ``num_stages``).
        shrink: names of tiles in ``meta`` that may be halved.

    Returns:
        The configuration that ran.

    Raises:
        The last ``OutOfResources`` when no smaller configuration is left; any other error at once.
    """
    name = getattr(getattr(kernel, "fn", None), "__name__", None) or getattr(kernel, "__name__", repr(kernel))
    key = (name, tuple(sorted(meta.items())))
    current = dict(_FITTED.get(key, meta))
    while True:
        try:
            kernel[grid(current)](*args, **current)
        except Exception as exc:
            if not _is_out_of_resources(exc):
                raise
            nxt = smaller(current, shrink)
            if nxt is None:
                raise
            current = nxt
            continue
        _FITTED[key] = current
        return current
