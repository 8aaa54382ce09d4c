"""Auxiliary losses: recorded by modules during forward, collected with :func:`aux_losses`.

A mechanism with a penalty or a side objective (adaptive span's L1 penalty,
ACT's ponder cost, a routing commitment loss, a compressive memory's
reconstruction loss) declares its loss names and default weights in its spec
(``AttentionSpec.aux_losses``) and records values in ``forward`` with
``self.record_aux_loss(name, value)``. A training loop adds them::

    loss = task_loss + sum(attnkit.aux_losses(model).values())

Values accumulate until collected (several forwards in one step add up), and
:func:`aux_losses` clears them by default. Collect before the backward of the
forward that recorded them: when a backward that frees the graph (no
``retain_graph``) runs through a forward's output without that forward's records,
they are dropped at its end (the step they belonged to is over, and their graph
may share freed nodes with the output's, so a later backward through them would
fail). A loop that never collects therefore keeps nothing, and a first step
without collection (a warm-up, a benchmark) leaves nothing behind for the next.
Records made while a backward runs (activation checkpointing recomputing a
forward) are ignored: the forward's own record stands. An uncollected value in a
graph that is never backpropagated keeps that graph alive: after
:data:`UNCOLLECTED_WARN_AFTER` such records of one loss without a collection, the
module warns once.

Under ``torch.compile`` the records are kept until collected (the binding to the
output is not traced).

Under a ``torch.func`` transform (``grad``, ``vmap``, ``jvp``) a record is the transform's wrapper: collect it
inside the transformed function (``loss = task + sum(attnkit.aux_losses(model).values())`` there). One left
uncollected when the transform ends has no storage; it is dropped at the module's next record or collection
outside any transform (kept, it failed a later ``torch.export`` of the module).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .errors import InvalidInputError
from .recompute import recomputing

__all__ = ["UNCOLLECTED_WARN_AFTER", "AuxLossMixin", "aux_losses", "bind_aux_records", "clear_aux_losses"]

#: records of one auxiliary loss in the graph, without a collection, after which a module warns (once)
UNCOLLECTED_WARN_AFTER = 100


#: the per-instance bookkeeping of recorded values (never copied or pickled)
_STATE_KEYS = ("_attnkit_aux", "_attnkit_aux_pending", "_attnkit_aux_unbound", "_attnkit_aux_warned",
               "_attnkit_aux_const", "_attnkit_aux_reentrant_warned")


class AuxLossMixin:
    """Recording side of auxiliary losses, shared by :class:`attnkit.Attention` and blocks.

    ``aux_weights`` (a dict set on an instance) overrides the declared default
    weights by name.
    """

    #: declared {name: default weight} when the class is not registered (the spec wins)
    declared_aux_losses: Mapping[str, float] = {}

    def __getstate__(self) -> dict[str, Any]:
        """A copy or a pickle leaves the recorded values behind: they belong to the original's graph (a recorded
        value is no graph leaf, so ``copy.deepcopy`` of a module between a forward and its backward failed)."""
        state = dict(super().__getstate__())  # type: ignore[misc]
        for key in _STATE_KEYS:
            state.pop(key, None)
        return state

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
        if recomputing():   # a forward recomputed during backward (activation checkpointing): its first run recorded
            if value.requires_grad and self.__dict__.get("_attnkit_aux_const", {}).get(name) \
                    and not self.__dict__.get("_attnkit_aux_reentrant_warned"):
                self.__dict__["_attnkit_aux_reentrant_warned"] = True
                who = getattr(self, "impl_name", type(self).__name__)
                warnings.warn(
                    f"{who!r}: the auxiliary loss {name!r} was recorded by a forward that ran without gradients and "
                    "is recomputed with them during backward (torch.utils.checkpoint with use_reentrant=True): the "
                    "recorded value is a constant and trains nothing; checkpoint with use_reentrant=False",
                    RuntimeWarning, stacklevel=2)
            return
        self.__dict__.setdefault("_attnkit_aux_const", {})[name] = not value.requires_grad
        compiling = torch.compiler.is_compiling()
        value = value.reshape(())
        # Each record is kept on its own and summed at collection: a running sum would make every record an
        # input of the next one's addition, and a compiled forward (one autograd node for the whole region)
        # would then backpropagate its output's gradient into an earlier step's freed graph.
        values = self.__dict__.setdefault("_attnkit_aux", {}).setdefault(name, [])
        if values:
            values[:] = _live(values)
        if not value.requires_grad and values and not values[-1].requires_grad:
            values[-1] = values[-1] + value   # constants (a diagnostic, a no-grad call): one running value
        else:
            values.append(value)
        if value.requires_grad:
            if not compiling:
                self.__dict__.setdefault("_attnkit_aux_unbound", []).append((name, value))
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
        """Recorded, not yet collected losses of this module alone (unweighted), each summed over its records."""
        store = self.__dict__.get("_attnkit_aux", {})
        return {name: _total(live) for name, values in store.items() if (live := _live(values))}

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
        for name, values in store.items():
            values = _live(values)
            if not values:
                continue
            value = _total(values)
            w = m.aux_weight(name) if weighted and isinstance(m, AuxLossMixin) else 1.0
            v = value * w if w != 1.0 else value
            out[name] = v if name not in out else out[name] + v
        if clear:
            store.clear()
            m.__dict__.pop("_attnkit_aux_pending", None)
    return out


def bind_aux_records(module: nn.Module, output: Any) -> None:
    """Tie the records ``module`` made in this forward to ``output`` (its tensor, or the first tensor of a tuple).

    :class:`attnkit.Attention` calls it at the end of ``forward`` and ``step``, and :class:`attnkit.Block` from a
    forward hook. When a backward that frees the graph runs through ``output`` and not through one of these
    records, the record is dropped from ``module`` at the end of that backward (see the module's docstring).
    """
    unbound = module.__dict__.pop("_attnkit_aux_unbound", None)
    if not unbound or torch.compiler.is_compiling():
        return
    out = output
    if isinstance(output, (tuple, list)):
        out = next((t for t in output if isinstance(t, Tensor)), None)
    if not isinstance(out, Tensor) or not out.requires_grad:
        return
    used: set[int] = set()
    for i, (_, value) in enumerate(unbound):
        value.register_hook(functools.partial(_mark_used, used, i))
    out.register_hook(functools.partial(_output_reached, weakref.ref(module), unbound, used))


def _mark_used(used: set[int], index: int, grad: Tensor) -> None:
    used.add(index)


def _output_reached(module_ref: Any, unbound: list, used: set[int], grad: Tensor) -> None:
    if not unbound or torch._C._autograd._get_current_graph_task_keep_graph():
        return   # a retained graph may be backpropagated again, with the records
    torch.autograd.Variable._execution_engine.queue_callback(
        functools.partial(_drop_unused, module_ref, unbound, used))


def _drop_unused(module_ref: Any, unbound: list, used: set[int]) -> None:
    """At the end of a backward through a forward's output: drop that forward's records it did not reach."""
    records = list(unbound)
    unbound.clear()              # the hooks' closures no longer keep the records (and their graphs) alive
    module = module_ref()
    if module is None:
        return
    store = module.__dict__.get("_attnkit_aux", {})
    counts = module.__dict__.get("_attnkit_aux_pending", {})
    for i, (name, value) in enumerate(records):
        if i in used:
            continue
        values = store.get(name, [])
        for j, kept in enumerate(values):
            if kept is value:
                del values[j]
                if counts.get(name, 0) > 0:
                    counts[name] -= 1
                break


def _live(values: list[Tensor]) -> list[Tensor]:
    """``values`` less the records a ``torch.func`` transform made and left when it ended (its wrappers, without
    storage, at a level no longer active: outside transforms every wrapper, inside one those of another, ended
    transform); all of them while Dynamo traces."""
    if torch.compiler.is_dynamo_compiling():
        return values
    f = torch._C._functorch
    if f.peek_interpreter_stack() is None:
        return [v for v in values if not f.is_functorch_wrapped_tensor(v)]
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    alive = {i.level() for i in retrieve_all_functorch_interpreters()}

    def ended(t: Tensor) -> bool:
        while f.is_functorch_wrapped_tensor(t):
            if f.maybe_get_level(t) not in alive:
                return True
            t = f.get_unwrapped(t)
        return False

    return [v for v in values if not ended(v)]


def _total(values: list[Tensor]) -> Tensor:
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total


def clear_aux_losses(model: nn.Module) -> None:
    """Forget recorded auxiliary losses without collecting them (e.g. after an evaluation pass)."""
    for m in model.modules():
        store = m.__dict__.get("_attnkit_aux")
        if store:
            store.clear()
        m.__dict__.pop("_attnkit_aux_pending", None)

