"""``reset_parameters()`` for modules the registry built: initialisation without a seeded build in hand.

PyTorch's recipe for large models builds them on the ``meta`` device (shapes, no memory),
moves them with ``module.to_empty(device=...)`` (uninitialised memory) and then calls
``reset_parameters()`` on every module that has one (FSDP's default ``param_init_fn`` does
the same). :class:`attnkit.Attention` and :class:`attnkit.Block` implement it by building a
fresh instance with the options the registry built this one with, on the CPU, and copying
its parameters and buffers in (each keeps its own device and dtype): random features,
centroids and sorting networks come back as a build makes them (from their ``seed``
option where they take one; from the global RNG otherwise, as ``nn.Linear`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import InvalidInputError

__all__ = ["reset_from_build"]


def reset_from_build(module: nn.Module, make: Callable[[], nn.Module] | None, what: str) -> None:
    """Copy the parameters and buffers of ``make()`` (a fresh build, made on the CPU) into ``module``.

    A tensor the fresh build does not have, or has in another shape (a buffer created lazily at a first call),
    is left as it is. Nothing is built when ``module`` holds no parameter or buffer. Without ``make`` (a module
    constructed from its class, e.g. the blocks of :class:`attnkit.Transformer`), the children's own
    ``reset_parameters()`` run instead, which is all there is to do when the module holds no tensor itself.

    Raises:
        InvalidInputError: ``make`` is None (the module was not built by the registry, so its options are
            unknown) and the module holds parameters or buffers of its own.
    """
    mine = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if b is not None)]
    if not mine:
        return
    if make is None:
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n, b in module.named_buffers(recurse=False) if b is not None]
        if own:
            raise InvalidInputError(
                f"reset_parameters: {what} holds {own} and was not built by attnkit.build / attnkit.build_block, "
                "so the options to initialise it with are unknown; build it by name, or initialise them yourself")
        _reset_children(module)
        return
    with torch.device("cpu"), torch.no_grad():
        fresh = make()
    source = dict(fresh.named_parameters())
    source.update((n, b) for n, b in fresh.named_buffers() if b is not None)
    with torch.no_grad():
        for name, t in mine:
            s = source.get(name)
            if s is not None and s.shape == t.shape:
                t.copy_(s)


def _reset_children(module: nn.Module) -> None:
    """``reset_parameters()`` of each child that has one; through a child that has none (a container such as
    :class:`attnkit.MultiHeadAttention`), of its children in turn."""
    for child in module.children():
        if hasattr(child, "reset_parameters"):
            child.reset_parameters()
        else:
            _reset_children(child)


def build_maker(spec: Any, options: dict[str, Any] | None, **fixed: Any) -> Callable[[], Any] | None:
    """``lambda: factory(**fixed, **options)`` for a registry-built module, or None when its options are unknown."""
    if spec is None or options is None:
        return None
    return lambda: spec.load_factory()(**fixed, **options)
