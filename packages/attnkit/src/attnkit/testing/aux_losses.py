"""The auxiliary-loss check: what a training loop that adds ``attnkit.aux_losses(model)`` relies on."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..aux import aux_losses
from .config import ConformanceConfig
from .context import Ctx, noise_like, seeded


def check_aux_losses(cfg: ConformanceConfig) -> str | None:
    """Specs that declare auxiliary losses: in training mode a forward records finite scalar losses in the graph,
    tied to its output.

    One case (the generator's plain case, the last declared causal mode), the precise dtype, two copies of one
    freshly built module in training mode, q, k, v requiring gradients:

    * a step that collects: each recorded loss is a finite scalar, and ``(out · g).sum() + sum(aux)``
      backpropagates to finite gradients (a value recorded outside the graph, a diagnostic such as compressive's
      reconstruction error with a parameter-free compression, is named in the note);
    * between a forward and its backward, ``copy.deepcopy`` of the module works and the copy holds no records
      (they belong to the original's graph; an EMA or best-model copy is taken anywhere in a loop);
    * a step that does not collect: a backward through the output alone leaves no record in the graph (they are
      tied to the forward's output, see :mod:`attnkit.aux`; a record made after the core's ``forward`` returned
      would be collected with the next step's loss, whose backward then runs through a freed graph).

    A spec that streams and records nothing on a plain call (a memory that records once it is full) is called on
    the same segment after three others (``state=``, ``return_state=True``). Under activation checkpointing the
    records are compared in the ``checkpointing`` check.
    """
    c = Ctx("aux_losses", cfg)
    declared = dict(getattr(c.spec, "aux_losses", None) or {})
    if not declared:
        c.skip("the spec declares no auxiliary losses")
    dt = c.precise()
    base = c.build(dtype=dt).train()
    case = c.cases(base, ["plain"])[-1]
    label = f"{case.describe(dt)}, training mode"
    inputs = c.inputs(case.L, case.S, dt)

    kw = case.kwargs(dt)
    primed = 0
    attn = copy.deepcopy(base)
    out, found, g = training_step(c, attn, label, inputs, kw, collect=True)
    if not found and c.caps.streaming is not None and c.caps.causal:
        # a memory that records only once it is full (compressive): the same segment after three others
        primed, kw = 3, {**kw, "causal": True}
        label = f"{label}, after {primed} segments (state=..., return_state=True)"
        attn = copy.deepcopy(base)
        out, found, g = training_step(c, attn, label, inputs, kw, collect=True, primed=primed)
    if not found:
        c.skip(f"{label}: a forward recorded no auxiliary loss (declared: {sorted(declared)}); nothing to check")
    constants = []
    for name, value in found.items():
        if value.numel() != 1 or not bool(torch.isfinite(value).all()):
            c.fail(f"{label}: auxiliary loss {name!r} is {value!r}, expected a finite scalar")
        if not value.requires_grad:
            constants.append(name)
    for i, t in enumerate(g):
        c.finite(t, label, f"gradient {i} of the output's loss plus the auxiliary losses")

    held = copy.deepcopy(base)
    x = [t.detach().clone().requires_grad_(True) for t in inputs]
    with seeded(c.cfg.seed + 5):
        _forward(c, held, label, x, kw, primed)   # a record pending, not yet backpropagated
    if not held.pending_aux_losses():
        c.fail(f"{label}: a second copy of the module recorded nothing on the same call")
    try:
        twin = copy.deepcopy(held)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: copy.deepcopy of the module between a forward and its backward raised "
               f"{type(exc).__name__}: {exc} (recorded values are no graph leaves: leave them out of the copy)")
    if twin.pending_aux_losses():
        c.fail(f"{label}: copy.deepcopy carried the original's recorded losses {sorted(twin.pending_aux_losses())} "
               "(they belong to the original's graph)")

    plain = copy.deepcopy(base)
    training_step(c, plain, label, inputs, kw, collect=False, primed=primed)
    left = {n for n in plain.pending_aux_losses() if n not in constants}
    if left:
        c.fail(f"{label}: after a backward through the output without collecting, {sorted(left)} stayed "
               "recorded; records must be tied to the forward's output (record inside forward/_attend, before "
               "Attention.forward returns, or call attnkit.aux.bind_aux_records(self, out)), or the next step's "
               "collected loss backpropagates through this step's freed graph")

    if constants:
        return (f"recorded without a graph (a diagnostic that trains nothing; kept until collected): "
                f"{sorted(constants)}")

def _forward(c: Ctx, attn: Any, label: str, x: list[Tensor], kw: dict[str, Any], primed: int) -> Tensor:
    """``attn(*x, **kw)``; after ``primed`` segment calls (no grad) when ``primed``, with their state."""
    if not primed:
        return c.call(attn, label, *x, grad=True, **kw)
    state = None
    try:
        with torch.no_grad():
            for _ in range(primed):
                _, state = attn(*(t.detach() for t in x), state=state, return_state=True, **kw)
        out, _ = attn(*x, state=state, return_state=True, **kw)
    except Exception as exc:  # noqa: BLE001 - reported as a failure with context
        c.fail(f"{label}: forward(state=..., return_state=True) raised {type(exc).__name__}: {exc}")
    return out


def training_step(c: Ctx, attn: Any, label: str, inputs: tuple[Tensor, Tensor, Tensor], kw: dict[str, Any], *,
                  collect: bool = True, checkpointed: bool = False, seed: int = 5, primed: int = 0
                  ) -> tuple[Tensor, dict[str, Tensor], list[Tensor | None]]:
    """One training step on copies of ``inputs`` (requiring gradients): forward (under
    ``torch.utils.checkpoint(use_reentrant=False)`` when ``checkpointed``; after ``primed`` segments when given),
    the auxiliary losses collected unweighted when ``collect``, and the gradients of ``(out · g).sum() + sum(aux)``
    with respect to q, k, v and the parameters (None where unused). Returns ``(out detached, {name: aux},
    gradients)``."""
    x = [t.detach().clone().requires_grad_(True) for t in inputs]
    how = "under torch.utils.checkpoint(use_reentrant=False)" if checkpointed else "plain"
    with seeded(c.cfg.seed + seed):
        if checkpointed:
            try:
                out = checkpoint(lambda a, b, d: attn(a, b, d, **kw), *x, use_reentrant=False)
            except Exception as exc:  # noqa: BLE001 - reported as a failure with context
                c.fail(f"{label}, {how}: forward raised {type(exc).__name__}: {exc}")
        else:
            out = _forward(c, attn, label, x, kw, primed)
        found = aux_losses(attn, weighted=False) if collect else {}
        loss = (out * noise_like(out, c.cfg.seed + 2300 + seed)).sum() + sum(found.values())
        params = [p for p in attn.parameters() if p.requires_grad]
        try:
            g = torch.autograd.grad(loss, [*x, *params], allow_unused=True)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"{label}, {how}: backward raised {type(exc).__name__}: {exc}")
    return out.detach(), found, list(g)
