"""Streaming state: one validated container for ``step`` and ``forward(..., state=...)``.

An implementation's ``_init_state``/``_step`` keep whatever they like (a KV
cache, a running sum, a segment memory) in :attr:`AttentionState.data`; the
base class wraps it with what it needs to refuse a wrong state with a clear
error: the owner (implementation and configuration), the batch size, dtype
and device, and the number of positions consumed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .errors import InvalidInputError

__all__ = ["AttentionState", "map_tensors"]


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply ``fn`` to every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


class AttentionState:
    """The state of a streaming attention after some positions.

    Attributes:
        owner: ``(implementation name, configuration fingerprint)``.
        batch: the batch size B it serves.
        dtype, device: of the tensors it holds (None until the first step
            when ``init_state`` was called without them).
        position: positions consumed so far (the offset of the next chunk).
        data: the implementation's own state.
    """

    __slots__ = ("owner", "batch", "dtype", "device", "position", "data")

    def __init__(self, owner: tuple[str, str], batch: int, dtype: torch.dtype | None,
                 device: torch.device | None, data: Any, position: int = 0) -> None:
        self.owner = owner
        self.batch = batch
        self.dtype = dtype
        self.device = _resolved(device)
        self.position = position
        self.data = data

    def validate(self, owner: tuple[str, str], q: Tensor, where: str) -> None:
        """Raise :class:`InvalidInputError` unless this state fits ``owner`` and ``q`` ``(B, H, T, D)``."""
        if self.owner[0] != owner[0]:
            raise InvalidInputError(
                f"{where}: state belongs to {self.owner[0]!r}, not {owner[0]!r}; create one with "
                f"init_state() of the module you step")
        if self.owner[1] != owner[1]:
            raise InvalidInputError(
                f"{where}: state was made by {owner[0]!r} with another configuration ({self.owner[1]}), "
                f"this module has ({owner[1]}); states do not carry across configurations")
        if q.shape[0] != self.batch:
            raise InvalidInputError(
                f"{where}: state was made for batch size {self.batch}, got q with batch size {q.shape[0]} "
                f"(q {tuple(q.shape)})")
        if self.dtype is not None and q.dtype != self.dtype:
            raise InvalidInputError(
                f"{where}: state holds {self.dtype} tensors, got q of dtype {q.dtype}; it is never cast "
                "silently: create the state with init_state(..., dtype=q.dtype)")
        if self.device is not None and q.device != self.device:
            raise InvalidInputError(
                f"{where}: state lives on {self.device}, got q on {q.device}; move the inputs or create "
                "the state on that device")

    def advanced(self, data: Any, steps: int, q: Tensor) -> AttentionState:
        """A new state after ``steps`` more positions (dtype/device fixed by ``q``)."""
        return AttentionState(self.owner, self.batch, q.dtype, q.device, data, self.position + steps)

    def detach(self) -> AttentionState:
        """The same state with every tensor detached from the autograd graph."""
        return AttentionState(self.owner, self.batch, self.dtype, self.device,
                              map_tensors(self.data, lambda t: t.detach()), self.position)

    def __repr__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.") if self.dtype else "any dtype"
        return (f"AttentionState({self.owner[0]!r}, batch={self.batch}, position={self.position}, "
                f"{dt}, device={self.device or 'any'})")


def _resolved(device: torch.device | str | None) -> torch.device | None:
    """``device`` with its index filled in (``"cuda"`` -> ``cuda:0`` on the current GPU), so that a state made
    with ``device="cuda"`` matches tensors on ``cuda:0``: a tensor's device always carries its index."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.empty(0, device=device).device
    return device
