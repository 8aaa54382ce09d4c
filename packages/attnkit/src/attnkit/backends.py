"""Backend availability and dispatch.

Backends are named strings: ``torch`` (the readable path, any device),
``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``), ``flex``
(FlexAttention, CUDA), ``numba`` (CPU kernels) and ``triton`` (CUDA kernels;
also runnable on CPU tensors under ``TRITON_INTERPRET=1`` when forced).
Availability is checked lazily and never imports a kernel module.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable

import torch

from .errors import BackendUnavailableError, InvalidInputError

ENV_BACKEND = "ATTNKIT_BACKEND"
KNOWN_BACKENDS = ("torch", "sdpa", "flex", "numba", "triton")


_IMPORTABLE: dict[str, bool] = {}
_REASONS: dict[tuple[str, str, bool, str], str | None] = {}


def clear_cache() -> None:
    """Forget cached availability (after installing numba or triton in the same process, or in tests)."""
    _IMPORTABLE.clear()
    _REASONS.clear()


def _importable(module: str) -> bool:
    hit = _IMPORTABLE.get(module)
    if hit is None:
        try:
            hit = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            hit = False
        _IMPORTABLE[module] = hit
    return hit


def check_env_backend() -> str:
    """``ATTNKIT_BACKEND`` stripped ('' when unset).

    Raises:
        InvalidInputError: a value that is no backend name (a misspelling is never ignored silently).
    """
    env = os.environ.get(ENV_BACKEND, "").strip()
    if env and env != "auto" and env not in KNOWN_BACKENDS:
        raise InvalidInputError(
            f"{ENV_BACKEND}: expected one of {list(KNOWN_BACKENDS)} or 'auto', got {env!r}")
    return env


def why_unavailable(backend: str, device: torch.device, *, forced: bool = False) -> str | None:
    """Return None when ``backend`` can run on ``device``, else the reason (cached)."""
    key = (backend, device.type, forced, os.environ.get("TRITON_INTERPRET", ""))
    if key in _REASONS:
        return _REASONS[key]
    reason = _why_unavailable(backend, device, forced=forced)
    _REASONS[key] = reason
    return reason


def _why_unavailable(backend: str, device: torch.device, *, forced: bool = False) -> str | None:
    if backend in ("torch", "sdpa"):
        return None
    if backend == "numba":
        if device.type != "cpu":
            return f"numba kernels run on CPU tensors, the tensors are on {device.type}"
        if not _importable("numba"):
            return "numba is not installed (pip install numba)"
        return None
    if backend == "triton":
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not (forced and interpret and device.type == "cpu"):
            return (f"triton kernels run on CUDA tensors, the tensors are on {device.type} "
                    "(set TRITON_INTERPRET=1 to run them on CPU tensors in the interpreter)")
        if not _importable("triton"):
            return "triton is not installed (pip install triton)"
        return None
    if backend == "flex":
        if device.type != "cuda":
            return f"FlexAttention runs compiled on CUDA tensors, the tensors are on {device.type}"
        return None
    # a third party's backend: assume available; its implementation decides
    return None


def select_backend(
    *,
    implementation: str,
    offered: Iterable[str],
    forward_only: Iterable[str] = (),
    requested: str = "auto",
    device: torch.device,
    needs_grad: bool,
) -> str:
    """Pick the backend to run.

    ``requested`` (from ``backend=``) wins; otherwise ``ATTNKIT_BACKEND`` forces a
    backend for implementations that offer it; otherwise the first offered
    backend that can run on ``device`` (skipping forward-only ones when a
    gradient is needed).

    Raises:
        InvalidInputError: ``requested`` is not offered by the implementation.
        BackendUnavailableError: a forced backend cannot run here.
    """
    offered = tuple(offered)
    forward_only = tuple(forward_only)
    forced = None
    if requested != "auto":
        if requested not in offered:
            raise InvalidInputError(
                f"backend: {implementation!r} offers backends {list(offered)} (or 'auto'), got {requested!r}"
            )
        forced = requested
    else:
        env = check_env_backend()  # a backend this implementation does not offer leaves it on auto
        if env and env != "auto" and env in offered:
            forced = env
    if forced is not None:
        reason = why_unavailable(forced, device, forced=True)
        if reason is None and needs_grad and forced in forward_only:
            reason = f"the {forced} path of {implementation!r} is forward-only and a gradient is needed"
        if reason is not None:
            raise BackendUnavailableError(
                f"backend {forced!r} was forced for {implementation!r} but cannot run: {reason}"
            )
        return forced
    for name in offered:
        if needs_grad and name in forward_only:
            continue
        if why_unavailable(name, device) is None:
            return name
    return "torch"
