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


def check_aux_losses(cfg: ConformanceConfig) -> None:
    """Specs that declare auxiliary losses: in training mode a forward records finite scalar losses in the graph,
    tied to its output.

    One case (the generator's plain case, the last declared causal mode), the precise dtype, two copies of one
    freshly built module in training mode, q, k, v requiring gradients:

    * a step that collects: each recorded loss is a finite scalar that requires grad (a value recorded outside the
      graph trains nothing), and ``(out · g).sum() + sum(aux)`` backpropagates to finite gradients;
    * between a forward and its backward, ``copy.deepcopy`` of the module works and the copy holds no records
      (they belong to the original's graph; an EMA or best-model copy is taken anywhere in a loop);
    * a step that does not collect: a backward through the output alone leaves nothing recorded (the records are
      tied to the forward's output, see :mod:`attnkit.aux`; a record made after the core's ``forward`` returned
      would be collected with the next step's loss, whose backward then runs through a freed graph).

    Under activation checkpointing the records are compared in the ``checkpointing`` check.
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

    attn = copy.deepcopy(base)
    out, found, g = training_step(c, attn, label, inputs, case.kwargs(dt), collect=True)
    if not found:
        c.skip(f"{label}: a forward recorded no auxiliary loss (declared: {sorted(declared)}); nothing to check")
    for name, value in found.items():
        if value.numel() != 1 or not bool(torch.isfinite(value).all()):
            c.fail(f"{label}: auxiliary loss {name!r} is {value!r}, expected a finite scalar")
        if not value.requires_grad:
            c.fail(f"{label}: auxiliary loss {name!r} was recorded outside the graph (requires_grad=False, with q, "
                   "k, v and the parameters requiring gradients): adding it to the loss trains nothing; record "
                   "the value the loss is, not a detached copy")
    for i, t in enumerate(g):
        c.finite(t, label, f"gradient {i} of the output's loss plus the auxiliary losses")

    held = copy.deepcopy(base)
    x = [t.detach().clone().requires_grad_(True) for t in inputs]
    with seeded(c.cfg.seed + 5):
        c.call(held, label, *x, grad=True, **case.kwargs(dt))   # a record pending, not yet backpropagated
    try:
        twin = copy.deepcopy(held)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: copy.deepcopy of the module between a forward and its backward raised "
               f"{type(exc).__name__}: {exc} (recorded values are no graph leaves: leave them out of the copy)")
    if twin.pending_aux_losses():
        c.fail(f"{label}: copy.deepcopy carried the original's recorded losses {sorted(twin.pending_aux_losses())} "
               "(they belong to the original's graph)")

    plain = copy.deepcopy(base)
    training_step(c, plain, label, inputs, case.kwargs(dt), collect=False)
    left = plain.pending_aux_losses()
    if left:
        c.fail(f"{label}: after a backward through the output without collecting, {sorted(left)} stayed "
               "recorded; records must be tied to the forward's output (record inside forward/_attend, before "
               "Attention.forward returns, or call attnkit.aux.bind_aux_records(self, out)), or the next step's "
               "collected loss backpropagates through this step's freed graph")


def training_step(c: Ctx, attn: Any, label: str, inputs: tuple[Tensor, Tensor, Tensor], kw: dict[str, Any], *,
                  collect: bool = True, checkpointed: bool = False, seed: int = 5
                  ) -> tuple[Tensor, dict[str, Tensor], list[Tensor | None]]:
    """One training step on copies of ``inputs`` (requiring gradients): forward (under
    ``torch.utils.checkpoint(use_reentrant=False)`` when ``checkpointed``), the auxiliary losses collected
    unweighted when ``collect``, and the gradients of ``(out · g).sum() + sum(aux)`` with respect to q, k, v and
    the parameters (None where unused). Returns ``(out detached, {name: aux}, gradients)``."""
    x = [t.detach().clone().requires_grad_(True) for t in inputs]
    how = "under torch.utils.checkpoint(use_reentrant=False)" if checkpointed else "plain"
    with seeded(c.cfg.seed + seed):
        if checkpointed:
            try:
                out = checkpoint(lambda a, b, d: attn(a, b, d, **kw), *x, use_reentrant=False)
            except Exception as exc:  # noqa: BLE001 - reported as a failure with context
                c.fail(f"{label}, {how}: forward raised {type(exc).__name__}: {exc}")
        else:
            out = c.call(attn, label, *x, grad=True, **kw)
        found = aux_losses(attn, weighted=False) if collect else {}
        loss = (out * noise_like(out, c.cfg.seed + 2300 + seed)).sum() + sum(found.values())
        params = [p for p in attn.parameters() if p.requires_grad]
        try:
            g = torch.autograd.grad(loss, [*x, *params], allow_unused=True)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"{label}, {how}: backward raised {type(exc).__name__}: {exc}")
    return out.detach(), found, list(g)
