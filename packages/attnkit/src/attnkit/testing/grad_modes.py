"""Checks of how an implementation meets PyTorch's execution modes: ``inference_mode``, ``autocast``, activation
checkpointing."""

from __future__ import annotations

import copy

import torch

from .aux_losses import training_step
from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx, grad_names, seeded


def check_inference_mode(cfg: ConformanceConfig) -> None:
    """Under ``torch.inference_mode`` the output equals a ``no_grad`` call's, and the same instance (with the
    same mask objects) then trains and evaluates again.

    A validation pass under ``inference_mode`` between training steps is ordinary PyTorch; a cache it fills
    (plans, block indices, tables, reused buffers) with *inference tensors* breaks the next training step
    (autograd cannot save them for backward) or the next call that writes the buffer in place. Build caches in
    :func:`attnkit.caching.kept_tensors`. Per case (the generator's plain, padding and mask-object cases, float32
    or the precise dtype): one call under ``inference_mode``, one under ``no_grad`` (equal on CPU to the bit);
    then in training mode a call with q, k, v requiring gradients and a backward (finite).
    """
    c = Ctx("inference_mode", cfg)
    dt = torch.float32 if "float32" in c.caps.dtypes else c.precise()
    attn = c.build(dtype=dt)
    cases = c.cases(attn, ["plain", "padding", "objects"])
    for n, case in enumerate(cases):
        label = case.describe(dt)
        kw = case.kwargs(dt)
        q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
        with torch.inference_mode(), seeded(cfg.seed + n):
            first = c.call(attn, f"{label}, under torch.inference_mode()", q, k, v, **kw)
        with seeded(cfg.seed + n):
            again = c.call(attn, f"{label}, under torch.no_grad() after an inference_mode call", q, k, v, **kw)
        c.close(again, first.clone(), f"{label}: a no_grad call after an inference_mode call disagrees with it",
                dtype=dt, against="inference_mode output", **c.exact())
    attn.train()
    for n, case in enumerate(cases):
        label = f"{case.describe(dt)}, training mode after inference_mode calls on the same instance"
        q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n, requires_grad=True)
        with seeded(cfg.seed + 7 * n + 1):
            out = c.call(attn, label, q, k, v, grad=True, **case.kwargs(dt))
        c.finite(out, label, "output")
        for name, g in zip(grad_names(attn), c.grads(attn, out, (q, k, v), label, seed=2100 + n)):
            c.finite(g, label, f"gradient of {name}")


def check_autocast(cfg: ConformanceConfig) -> None:
    """Under ``torch.autocast`` (the device's type, its default dtype: bfloat16 on CPU, float16 on CUDA) float32
    inputs give exactly what the same inputs cast to the autocast dtype give outside it, in that dtype, as SDPA
    does; their gradients arrive in float32, finite.

    An implementation that does not declare the autocast dtype runs in float32 (the output equals the float32
    call's). Cases: the generator's plain and padding cases (each declared causal mode).
    """
    c = Ctx("autocast", cfg)
    if "float32" not in c.caps.dtypes:
        c.skip("the spec does not declare float32, the dtype autocast casts from")
    kind = c.device.type
    try:
        with torch.autocast(kind):
            amp = torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError, ValueError) as exc:
        c.skip(f"torch.autocast({kind!r}) is not available here: {exc}")
    want = amp if DTYPE_NAMES.get(amp) in c.caps.dtypes else torch.float32
    attn = c.build(dtype=torch.float32)
    for n, case in enumerate(c.cases(attn, ["plain", "padding"])):
        label = f"{case.describe(torch.float32)}, under torch.autocast({kind!r}, dtype={amp})"
        kw = case.kwargs(torch.float32)
        q, k, v = c.inputs(case.L, case.S, torch.float32, seed_offset=n, requires_grad=True)
        with torch.autocast(kind), seeded(cfg.seed + n):
            out = c.call(attn, label, q, k, v, grad=True, **kw)
        if out.dtype != want:
            c.fail(f"{label}: output dtype {out.dtype}, expected {want} (the autocast dtype"
                   + (")" if want == amp else f" is not declared, so float32; the spec declares {c.caps.dtypes})"))
        cast = [t.detach().to(want).requires_grad_(True) for t in (q, k, v)]
        with seeded(cfg.seed + n):
            ref = c.call(attn, f"{case.describe(want)} (outside autocast)", *cast, grad=True, **case.kwargs(want))
        c.close(out, ref, f"{label}: differs from the inputs cast to {want} outside autocast", dtype=want,
                against=f"{DTYPE_NAMES.get(want)} inputs outside autocast", **c.exact())
        for name, g in zip(grad_names(attn), c.grads(attn, out, (q, k, v), label, seed=2200 + n)):
            if g is not None and g.dtype != torch.float32:
                c.fail(f"{label}: the gradient of {name} has dtype {g.dtype}, expected float32 (its tensor's)")
            c.finite(g, label, f"gradient of {name}")


def check_checkpointing(cfg: ConformanceConfig) -> None:
    """Under ``torch.utils.checkpoint(use_reentrant=False)`` two training steps in a row give what they give
    without it: the outputs, the auxiliary losses, the gradients of q, k, v and of the parameters, and the
    buffers after each step.

    Checkpointing runs the forward again during backward to rebuild what it saved: a backward that reads
    ``ctx.saved_tensors`` twice fails there ("Unpack is being triggered for a tensor that was already unpacked
    once"); a forward that changes state in training (an EMA update) must record and update once and route the
    recomputation with the state the first run saw (:func:`attnkit.recompute.recomputing`). Cases: the
    generator's plain and padding cases (each declared causal mode), the precise dtype, each backend that trains
    and runs here (the default one when the factory takes no ``backend``), two copies of one freshly built module
    in training mode, the same random seed on both sides.
    """
    c = Ctx("checkpointing", cfg)
    dt = c.precise()
    backends, _ = c.backends()
    for backend in [b for b in backends if c.trains(b)]:
        _checkpointed_steps(c, dt, backend)


def _checkpointed_steps(c: Ctx, dt: torch.dtype, backend: str | None) -> None:
    base = c.build(dtype=dt, backend=backend).train()
    on = "" if backend is None else f", backend={backend!r}"
    for n, case in enumerate(c.cases(base, ["plain", "padding"])):
        kw = case.kwargs(dt)
        inputs = c.inputs(case.L, case.S, dt, seed_offset=n)
        plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
        for rep in range(2):
            label = f"{case.describe(dt)}{on}, training mode, step {rep + 1}"
            what = f"{label}, under torch.utils.checkpoint(use_reentrant=False)"
            out, aux, g = training_step(c, plain, label, inputs, kw, seed=40 * n + rep)
            out_c, aux_c, g_c = training_step(c, ckpt, label, inputs, kw, checkpointed=True, seed=40 * n + rep)
            c.close(out_c, out, what, dtype=dt, against="the plain step's output")
            if sorted(aux_c) != sorted(aux):
                c.fail(f"{what}: recorded the auxiliary losses {sorted(aux_c)}, the plain step {sorted(aux)}")
            for name in aux:
                c.close(aux_c[name].detach(), aux[name].detach(), what, dtype=dt, what=f"auxiliary loss {name!r}",
                        against="the plain step's")
            left = ckpt.pending_aux_losses()
            if left:
                c.fail(f"{what}: {sorted(left)} recorded again while backward recomputed the forward")
            for i, (a, b) in enumerate(zip(g_c, g)):
                if (a is None) != (b is None):
                    c.fail(f"{what}: gradient {i} (q, k, v, then parameters) is "
                           f"{'missing' if a is None else 'present'} here, not in the plain step")
                if a is not None and b is not None:
                    c.close(a, b, what, dtype=dt, what=f"gradient {i} (q, k, v, then parameters)",
                            against="the plain step's")
            mine = dict(ckpt.named_buffers())
            for name, b in plain.named_buffers():
                if b is not None and mine.get(name) is not None and mine[name].shape == b.shape:
                    c.close(mine[name], b, what, dtype=dt, what=f"buffer {name!r} after the step",
                            against="the plain step's")
