"""Auxiliary losses: recorded by modules during forward, collected with :func:`aux_losses`.

A mechanism with a penalty or a side objective (adaptive span's L1 penalty,
ACT's ponder cost, a routing commitment loss, a compressive memory's
reconstruction loss) declares its loss names and default weights in its spec
(``AttentionSpec.aux_losses``) and records values in ``forward`` with
``self.record_aux_loss(name, value)``. A training loop adds them::

    loss = task_loss + sum(attnkit.aux_losses(model).values())

Values accumulate until collected (several forwards in one step add up), and
:func:`aux_losses` clears them by default. An uncollected value that is in the
graph keeps that graph, and the activations it saved, alive: after
:data:`UNCOLLECTED_WARN_AFTER` such records of one loss without a collection, the
module warns once (a training loop that never calls :func:`aux_losses` grows in
memory step by step).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from .errors import InvalidInputError

__all__ = ["UNCOLLECTED_WARN_AFTER", "AuxLossMixin", "aux_losses", "clear_aux_losses"]

#: records of one auxiliary loss in the graph, without a collection, after which a module warns (once)
UNCOLLECTED_WARN_AFTER = 100


class AuxLossMixin:
    """Recording side of auxiliary losses, shared by :class:`attnkit.Attention` and blocks.

    ``aux_weights`` (a dict set on an instance) overrides the declared default
    weights by name.
    """

    #: declared {name: default weight} when the class is not registered (the spec wins)
    declared_aux_losses: Mapping[str, float] = {}

    def _declared_aux(self) -> Mapping[str, float]:
        spec = getattr(self, "spec", None) or getattr(self, "block_spec", None)
        declared = getattr(spec, "aux_losses", None)
        return declared if declared else type(self).declared_aux_losses

    def record_aux_loss(self, name: str, value: Tensor) -> None:
        """Add ``value`` (a scalar tensor, in the graph) to the auxiliary loss ``name``.

        Raises:
            InvalidInputError: ``name`` is not declared by the spec, or ``value`` is not a scalar tensor.
        """
        declared = self._declared_aux()
        if name not in declared:
            who = getattr(self, "impl_name", type(self).__name__)
            raise InvalidInputError(
                f"record_aux_loss: {who!r} records an auxiliary loss {name!r} its spec does not declare "
                f"(declared: {sorted(declared) or 'none'}); add it to AttentionSpec.aux_losses")
        if not isinstance(value, Tensor) or value.numel() != 1:
            raise InvalidInputError(f"record_aux_loss: {name!r} must be a scalar tensor, got {value!r}"[:200])
        store = self.__dict__.setdefault("_attnkit_aux", {})
        store[name] = value.reshape(()) if name not in store else store[name] + value.reshape(())
        if value.requires_grad:
            counts = self.__dict__.setdefault("_attnkit_aux_pending", {})
            counts[name] = counts.get(name, 0) + 1
            if counts[name] == UNCOLLECTED_WARN_AFTER and not self.__dict__.get("_attnkit_aux_warned"):
                self.__dict__["_attnkit_aux_warned"] = True
                who = getattr(self, "impl_name", type(self).__name__)
                warnings.warn(
                    f"{who!r} recorded the auxiliary loss {name!r} {UNCOLLECTED_WARN_AFTER} times without a "
                    "collection; each uncollected value keeps its graph and the activations it saved alive. Add "
                    "sum(attnkit.aux_losses(model).values()) to the training loss each step, or call "
                    "attnkit.clear_aux_losses(model)", RuntimeWarning, stacklevel=2)

    def pending_aux_losses(self) -> dict[str, Tensor]:
        """Recorded, not yet collected losses of this module alone (unweighted)."""
        return dict(self.__dict__.get("_attnkit_aux", {}))

    def aux_weight(self, name: str) -> float:
        override = self.__dict__.get("aux_weights") or {}
        if name in override:
            return float(override[name])
        return float(self._declared_aux().get(name, 1.0))


def aux_losses(model: nn.Module | Any, *, weighted: bool = True, clear: bool = True) -> dict[str, Tensor]:
    """Collect the auxiliary losses recorded by every module of ``model`` since the last collection.

    Args:
        model: any module (an attention, a block, a whole model); its
            submodules are searched.
        weighted: multiply each value by its weight (the spec's default, or
            the module's ``aux_weights`` override).
        clear: forget the collected values (the default: one collection per step).

    Returns:
        ``{name: scalar tensor}`` summed over modules; empty when nothing was recorded.

    Raises:
        InvalidInputError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"aux_losses: expected an nn.Module, got {type(model).__name__}")
    out: dict[str, Tensor] = {}
    for m in model.modules():
        store = m.__dict__.get("_attnkit_aux")
        if not store:
            continue
        for name, value in store.items():
            w = m.aux_weight(name) if weighted and isinstance(m, AuxLossMixin) else 1.0
            v = value * w if w != 1.0 else value
            out[name] = v if name not in out else out[name] + v
        if clear:
            store.clear()
            m.__dict__.pop("_attnkit_aux_pending", None)
    return out


def clear_aux_losses(model: nn.Module) -> None:
    """Forget recorded auxiliary losses without collecting them (e.g. after an evaluation pass)."""
    for m in model.modules():
        store = m.__dict__.get("_attnkit_aux")
        if store:
            store.clear()
        m.__dict__.pop("_attnkit_aux_pending", None)

