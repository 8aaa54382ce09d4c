"""Backend availability and dispatch.

Backends are named strings: ``torch`` (the readable path, any device),
``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``), ``flex``
(FlexAttention, CUDA), ``numba`` (CPU kernels) and ``triton`` (CUDA kernels;
also runnable on CPU tensors under ``TRITON_INTERPRET=1`` when forced).
Availability is checked lazily, never imports a kernel module, and is cached
per (backend, device type, forced, ``TRITON_INTERPRET``); :func:`clear_cache`
forgets it (after installing numba or triton in the same process, or in tests).

``ATTNKIT_BACKEND`` forces a backend for every implementation that offers it;
an implementation that does not offer it stays on ``auto``. A value that names
no backend (not one of :data:`KNOWN_BACKENDS`, not ``auto`` and not a backend a
registered spec declares, e.g. a third party's ``"mykernel"``) is an error, never
ignored silently. ``backend=`` given to :func:`attnkit.build` must be ``"auto"``
or one the spec offers (:func:`check_offered`), refused at build.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from typing import Any

import torch

from .errors import BackendUnavailableError, InvalidInputError

ENV_BACKEND = "ATTNKIT_BACKEND"
KNOWN_BACKENDS = ("torch", "sdpa", "flex", "numba", "triton")


_IMPORTABLE: dict[str, bool] = {}
_REASONS: dict[tuple[str, str, bool, str], str | None] = {}
#: backend names declared by registered specs beyond KNOWN_BACKENDS (third parties' own)
_DECLARED: set[str] = set()


def declare_backends(names: Iterable[str]) -> None:
    """Record backend names that registered specs offer (called by the registry), so that
    ``ATTNKIT_BACKEND`` may name a third party's backend."""
    _DECLARED.update(n for n in names if isinstance(n, str) and n not in KNOWN_BACKENDS)


def valid_backend_names(offered: Iterable[str] = ()) -> list[str]:
    """``'auto'``, :data:`KNOWN_BACKENDS`, then the other backends registered specs (or ``offered``) declare."""
    extra = sorted((_DECLARED | set(offered)) - set(KNOWN_BACKENDS) - {"auto"})
    return ["auto", *KNOWN_BACKENDS, *extra]


def check_offered(implementation: str, offered: Iterable[str], requested: Any) -> str:
    """``requested`` when it is ``"auto"`` or a backend ``offered`` by ``implementation``.

    Args:
        implementation: the registered name (for the message).
        offered: the spec's ``capabilities.backends``, in order of preference.
        requested: the ``backend=`` option.

    Raises:
        InvalidInputError: ``requested`` is not a str, or a backend the implementation does not offer
            (the message names the offered ones).
    """
    offered = list(offered)
    if not isinstance(requested, str):
        raise InvalidInputError(
            f"backend: expected 'auto' or one of the backends {implementation!r} offers {offered}, "
            f"got {requested!r} ({type(requested).__name__})")
    if requested != "auto" and requested not in offered:
        raise InvalidInputError(
            f"backend: {implementation!r} offers backends {offered} (or 'auto'), got {requested!r}; "
            f"pass one of them, or leave backend='auto'")
    return requested


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


def check_env_backend(offered: Iterable[str] = ()) -> str:
    """``ATTNKIT_BACKEND`` stripped ('' when unset).

    Args:
        offered: the backends of the implementation asking (a third party's own names are valid too).

    Raises:
        InvalidInputError: a value that is no backend name (a misspelling is never ignored silently);
            the message names the valid ones.
    """
    env = os.environ.get(ENV_BACKEND, "").strip()
    if env and env not in valid_backend_names(offered):
        raise InvalidInputError(
            f"{ENV_BACKEND}: expected one of {valid_backend_names(offered)}, got {env!r}; "
            f"fix or unset {ENV_BACKEND}")
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
    if check_offered(implementation, offered, requested) != "auto":
        forced = requested
    else:
        env = check_env_backend(offered)  # a backend this implementation does not offer leaves it on auto
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
