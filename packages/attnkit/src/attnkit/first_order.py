"""Backward passes that are first order only: second derivatives through them raise, never come out wrong.

A custom :class:`torch.autograd.Function` whose backward reads values saved from the forward
(probabilities, normalisers, hash buckets) treats them as constants; differentiating that backward
again (``create_graph=True``: gradient penalties, meta-learning, Hessian-vector products) then gives
second derivatives with terms missing, silently. :func:`torch.autograd.function.once_differentiable`
refuses only when the incoming gradient itself requires grad; with a plain incoming gradient (the usual
gradient penalty, ``grad(loss, x, create_graph=True)``) it returns constants and the terms are lost.

:func:`first_order` refuses in both cases: under ``create_graph=True`` every gradient the backward
returns carries a node that raises :class:`attnkit.errors.UnsupportedFeatureError` when differentiated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .errors import UnsupportedFeatureError

__all__ = ["first_order", "first_order_path"]


class _Refuse(torch.autograd.Function):
    """Identity on the first ``n`` tensors (gradients); the others (anchors: the guarded function's saved inputs)
    only put this node on the graph's paths back to them. Its backward raises, naming the guarded function."""

    generate_vmap_rule = True   # torch.func transforms (the forward is torch operators only)

    @staticmethod
    def forward(what: str, n: int, *tensors: torch.Tensor) -> Any:
        out = tuple(g.view_as(g) for g in tensors[:n])
        return out if len(out) != 1 else out[0]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.what = inputs[0]

    @staticmethod
    def backward(ctx: Any, *_: Any) -> Any:
        raise UnsupportedFeatureError(
            ctx.what, "second derivatives (a gradient taken with create_graph=True, then differentiated)",
            "its backward is first order: it reads values saved from the forward as constants, so a second "
            "derivative through it would miss terms",
            instead="docs/conformance.md, check 'double_backward', lists which implementations and backends "
                    "give second derivatives")


def first_order(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a :class:`torch.autograd.Function`'s ``backward`` (under ``@staticmethod``).

    The backward runs without recording a graph; when autograd asked for one (``create_graph=True``),
    the gradients it returns are wrapped so that differentiating them back to the function's inputs raises
    :class:`attnkit.errors.UnsupportedFeatureError` naming the function. Otherwise nothing changes. The
    node reaches the inputs through the tensors the function saved with ``ctx.save_for_backward``: a
    function that saves none of its inputs (nor its outputs) is not guarded on those paths.
    """

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grad_outputs: Any) -> Any:
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            grads = backward(ctx, *grad_outputs)
        if not create_graph:
            return grads
        single = not isinstance(grads, tuple)
        items = (grads,) if single else grads
        idx = [i for i, g in enumerate(items) if isinstance(g, torch.Tensor) and g.is_floating_point()]
        if not idx:
            return grads
        # a Function's class name, or a custom operator's (GeneratedBackwardFor_<ns>_<op>_default)
        name = getattr(ctx, "what", None) or (type(ctx).__name__.removesuffix("Backward")
                                              .removeprefix("GeneratedBackwardFor_").removesuffix("_default"))
        # the saved tensors that carry a graph (the inputs, or outputs whose graph leads to them) anchor the
        # refusing node on the paths from these gradients back to the inputs: a second backward meets it
        try:
            saved = getattr(ctx, "saved_tensors", ())
        except RuntimeError:   # torch.utils.checkpoint unpacks a saved tensor once, and the backward did
            saved = ()         # unanchored: the refusing node then sits on the gradients themselves
        anchors = [t for t in saved if isinstance(t, torch.Tensor) and t.requires_grad]
        grads_in = [items[i].detach().requires_grad_(not anchors) for i in idx]
        wrapped = _Refuse.apply(name, len(idx), *grads_in, *anchors)
        wrapped = (wrapped,) if len(idx) == 1 else wrapped
        out = list(items)
        for i, w in zip(idx, wrapped):
            out[i] = w
        return out[0] if single else tuple(out)

    return wrapper


class _Path(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, what: str) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.what = inputs[1]

    @staticmethod
    @first_order
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None

    @staticmethod
    def jvp(ctx: Any, t: torch.Tensor | None, _what: Any) -> torch.Tensor | None:
        # forward-mode AD (dual tensors) through the identity: the tangent, a view as the output is
        return None if t is None else t.view_as(t)


def first_order_path(x: torch.Tensor, what: str = "") -> torch.Tensor:
    """``x`` itself, on a path whose gradient is first order only.

    For differentiable torch code whose gradient is right only to first order (an implicit-function
    correction with a detached Jacobian, a straight-through estimate): route the term through this, and a
    second derivative through it raises :class:`attnkit.errors.UnsupportedFeatureError` (naming ``what``)
    instead of coming out with terms missing. First derivatives are unchanged.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _Path.apply(x, what or "a first-order path")
