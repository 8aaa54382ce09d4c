"""Attention under :func:`torch.autocast`.

SDPA is on autocast's lower-precision list: inside ``torch.autocast(device, dtype)`` its
float32 inputs are cast to ``dtype`` and its output has that dtype. Every attnkit
implementation behaves the same way: :meth:`attnkit.Attention.forward` (and ``step``)
casts q, k and v (floating, not float64) to the autocast dtype when the implementation
declares it, and runs the implementation with autocast off, so its own float32 work
(sorting networks, centroids, pseudo-inverses, float32 accumulation of half inputs)
is not cast again op by op. An implementation that does not declare the autocast dtype
runs in float32. Gradients reach float32 inputs in float32 through the cast.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["autocast_dtype", "autocast_inputs"]

_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def autocast_dtype(device: torch.device, declared: Any) -> torch.dtype | None:
    """The dtype q, k and v are cast to under autocast on ``device``'s type, or None when autocast is off there.

    Args:
        device: the inputs' device.
        declared: the implementation's dtype names (``Capabilities.dtypes``).

    Returns:
        None (autocast off on this device type: nothing to do), or the autocast dtype when
        ``declared`` names it, or ``torch.float32`` when it does not (inputs of other floating
        dtypes but float64 are then cast to float32).
    """
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
        dtype = torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError):   # a device type autocast does not know
        return None
    return dtype if _NAMES.get(dtype) in tuple(declared) else torch.float32


def autocast_inputs(q: Any, k: Any, v: Any, declared: Any) -> tuple[Any, Any, Any] | None:
    """``(q, k, v)`` cast for a call under autocast, or None when autocast is off on ``q``'s device.

    Each floating tensor but float64 is cast to :func:`autocast_dtype`; anything else is returned as given
    (the caller's validation reports it). The caller then runs with autocast off::

        cast = autocast_inputs(q, k, v, caps.dtypes)
        if cast is not None:
            with torch.autocast(q.device.type, enabled=False):
                return fn(*cast, ...)
    """
    dtype = autocast_dtype(q.device, declared) if isinstance(q, torch.Tensor) else None
    if dtype is None:
        return None
    q, k, v = (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
               else t for t in (q, k, v))
    return q, k, v
