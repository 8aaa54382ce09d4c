"""Gradient checks: finite everywhere, zero at padded keys; training mode; ``torch.autograd.gradcheck``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx, grad_names, make_inputs, noise_like, seeded


def check_gradients(cfg: ConformanceConfig) -> None:
    """Gradients of q, k, v and parameters are finite; padded keys get zero gradient.

    float32 and float64 (as tested), over the case generator's plain,
    padding, ``attn_mask``, mask-object and cross cases as declared; k and v
    of padded keys must get exactly-zero gradients.
    """
    c = Ctx("gradients", cfg)
    for dt in c.float_dtypes():
        attn = c.build(dtype=dt)
        names = grad_names(attn)
        for n, case in enumerate(c.cases(attn, ["plain", "padding", "tensor", "objects", "cross"])):
            label = case.describe(dt)
            q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n, requires_grad=True)
            out = c.call(attn, label, q, k, v, grad=True, **case.kwargs(dt))
            g = c.grads(attn, out, (q, k, v), label, seed=1200 + n)
            if g[2] is None:
                c.fail(f"{label}: the output has no gradient with respect to v")
            for name, t in zip(names, g):
                c.finite(t, label, f"gradient of {name}")
            kpm = case.key_padding_mask
            if kpm is None:
                continue
            pad = ~kpm[:, None, :, None]
            for name, t in (("k", g[1]), ("v", g[2])):
                if t is None:
                    continue
                leak = t.detach().masked_select(pad.expand_as(t))
                if leak.numel() and bool((leak != 0).any()):
                    c.fail(f"{label}: the gradient of {name} at padded key positions must be 0, got max "
                           f"|grad| = {leak.abs().max().item():.3g}")



def check_training_mode(cfg: ConformanceConfig) -> None:
    """In training mode (``module.train()``) outputs and the gradients of q, k, v and parameters are finite.

    Every other check builds the module in eval mode; this one runs what
    happens only in training: noise (Gumbel-Sinkhorn), feature redraws,
    buffers updated from the batch (k-means centroids), stochastic choices.
    Each declared float dtype, the generator's plain and padding cases (each
    declared causal mode), two forward and backward passes in a row (a
    training-time buffer update must leave the next call finite).
    """
    c = Ctx("training_mode", cfg)
    for dt in c.float_dtypes():
        attn = c.build(dtype=dt).train()
        names = grad_names(attn)
        for n, case in enumerate(c.cases(attn, ["plain", "padding"])):
            for rep in range(2):
                label = f"{case.describe(dt)}, training mode, call {rep + 1}"
                q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n, requires_grad=True)
                with seeded(cfg.seed + 31 * n + rep):
                    out = c.call(attn, label, q, k, v, grad=True, **case.kwargs(dt))
                    c.finite(out, label, "output")
                    g = c.grads(attn, out, (q, k, v), label, seed=1300 + n)
                for name, t in zip(names, g):
                    c.finite(t, label, f"gradient of {name}")

def check_gradcheck(cfg: ConformanceConfig) -> None:
    """:func:`torch.autograd.gradcheck` passes in float64 on tiny shapes.

    Shapes: ``gradcheck_shapes`` (default ``shapes`` with B = 1); with respect
    to q, k, v; ``fast_mode=True``, eps 1e-6, atol 1e-5, rtol 1e-3. Run on the
    ``torch`` backend and, when different, the backend automatic dispatch picks
    for float64 inputs that need a gradient. Cases: the generator's plain,
    padding, bool ``attn_mask`` and (unpadded) cross cases, as declared.
    """
    c = Ctx("gradcheck", cfg)
    if "float64" not in c.caps.dtypes:
        c.skip("the spec does not declare float64, which gradcheck needs")
    dt = torch.float64
    B, H, L, S, D, E = cfg.gradcheck_shapes or (1, *cfg.shapes[1:])
    auto = c.build(dtype=dt)
    probe = make_inputs(B, H, L, L, D, E, dtype=dt, device=c.device, requires_grad=True)
    with torch.enable_grad():
        try:
            resolved = auto.resolve_backend(*probe)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"resolving the automatic backend for float64 inputs that need a gradient raised "
                   f"{type(exc).__name__}: {exc}")
    backends = ["torch"] + ([resolved] if resolved != "torch" else [])
    for backend in backends:
        attn = c.build(dtype=dt, **({"backend": backend} if "backend" in c.takes else {}))
        cases = c.cases(attn, ["plain", "padding", "tensor", "cross"], B=B, L=L, S=S)
        cases = [cs for cs in cases if not (isinstance(cs.kw.get("attn_mask"), Tensor)
                                            and cs.kw["attn_mask"].is_floating_point())
                 and not (cs.family == "cross" and cs.key_padding_mask is not None)]
        for n, case in enumerate(cases):
            label = f"backend={backend!r}, {case.label}, B={B}, H={H}, L={case.L}, S={case.S}, D={D}, E={E}, " \
                    f"{DTYPE_NAMES[dt]}"
            q, k, v = make_inputs(B, H, case.L, case.S, D, E, dtype=dt, device=c.device,
                                  seed=cfg.seed * 1000 + 1300 + n, requires_grad=True)
            kw = case.kwargs(dt)

            def fn(q: Tensor, k: Tensor, v: Tensor, attn: Any = attn, kw: dict[str, Any] = kw) -> Tensor:
                return attn(q, k, v, **kw)

            try:
                torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True)
            except Exception as exc:  # noqa: BLE001 - GradcheckError or the implementation's own
                msg = str(exc)
                c.fail(f"{label}: gradcheck (inputs: 0 = q, 1 = k, 2 = v) failed ({type(exc).__name__}): "
                       f"{msg[:1500]}{' ...' if len(msg) > 1500 else ''}")


def _penalty(attn: Any, kw: dict[str, Any], x: list[Tensor], w: Tensor, r: list[Tensor],
             create_graph: bool) -> tuple[Any, list[Tensor]]:
    """``Σ <grad(<attn(x), w>, x_i), r_i>`` and the leaves ``x`` it was taken at."""
    x = [t.detach().requires_grad_(True) for t in x]
    with torch.enable_grad():
        out = attn(*x, **kw)
        g = torch.autograd.grad(out, x, w, create_graph=create_graph, allow_unused=True)
    return sum((gi * ri).sum() for gi, ri in zip(g, r) if gi is not None), x


def check_double_backward(cfg: ConformanceConfig) -> str:
    """Second derivatives are right or refused: never silently wrong.

    A gradient penalty takes ``g = grad(out, (q, k, v), create_graph=True)`` and differentiates a function of
    ``g`` again. For every backend that can run here and trains (float64, ``gradcheck_shapes``, the plain case
    in each declared causal mode): ``s = Σ <g_i, r_i>`` for random ``r``, then ``grad(s, (q, k, v))``. Either
    that raises (the implementation refuses second derivatives; :func:`attnkit.first_order.first_order` does it
    for a custom backward), or its directional derivative along a random ``d`` equals the central difference
    of ``s`` (step 1e-6) to 1e-6 + 1e-5·|value|. Gradients that carry no graph at all under ``create_graph``
    fail too: a user's second backward would see constants. The note lists the backends that refused.
    """
    c = Ctx("double_backward", cfg)
    if "float64" not in c.caps.dtypes:
        c.skip("the spec does not declare float64, which the central difference needs")
    dt = torch.float64
    B, H, L, _, D, E = cfg.gradcheck_shapes or (1, *cfg.shapes[1:])
    backends, _ = c.backends()
    refused: list[str] = []
    for backend in backends:
        if not c.trains(backend):
            continue
        attn = c.build(dtype=dt, backend=backend)
        for n, case in enumerate(c.cases(attn, ["plain"], B=B, L=L, S=L)):
            label = f"backend={backend!r}, {case.describe(dt)}" if backend else case.describe(dt)
            kw = case.kwargs(dt)
            q, k, v = make_inputs(B, H, case.L, case.S, D, E, dtype=dt, device=c.device,
                                  seed=cfg.seed * 1000 + 1400 + n)
            base = cfg.seed * 1000 + 1410 + 10 * n
            w = noise_like(v, base, scale=1.0)                    # L = S: the output has v's shape
            r = [noise_like(t, base + 1 + i, scale=1.0) for i, t in enumerate((q, k, v))]
            d = [noise_like(t, base + 4 + i, scale=1.0) for i, t in enumerate((q, k, v))]
            try:
                s, x = _penalty(attn, kw, [q, k, v], w, r, True)
            except Exception as exc:  # noqa: BLE001 - a first-order refusal may come this early
                refused.append(f"{backend or 'default'} ({type(exc).__name__} on create_graph)")
                continue
            if not isinstance(s, Tensor) or not s.requires_grad:
                c.fail(f"{label}: the gradients of q, k, v carry no graph under create_graph=True: a second "
                       "backward would treat them as constants; refuse instead (attnkit.first_order.first_order)")
            try:
                with torch.enable_grad():
                    h = torch.autograd.grad(s, x, allow_unused=True)
            except Exception as exc:  # noqa: BLE001 - refusing second derivatives is allowed
                refused.append(f"{backend or 'default'} ({type(exc).__name__})")
                continue
            analytic = sum(float((hi * di).sum()) for hi, di in zip(h, d) if hi is not None)
            eps = 1e-6
            with torch.no_grad():
                plus = [t + eps * di for t, di in zip((q, k, v), d)]
                minus = [t - eps * di for t, di in zip((q, k, v), d)]
            numeric = (float(_penalty(attn, kw, plus, w, r, False)[0])
                       - float(_penalty(attn, kw, minus, w, r, False)[0])) / (2 * eps)
            if not abs(analytic - numeric) <= 1e-6 + 1e-5 * abs(numeric):
                c.fail(f"{label}: second derivatives are wrong: the directional derivative of <grad(out), r> "
                       f"along d is {analytic:.9g} by double backward and {numeric:.9g} by central difference. "
                       "A backward that reads values saved from the forward as constants must refuse "
                       "create_graph (decorate it with attnkit.first_order.first_order)")
    return f"refused second derivatives: {', '.join(refused)}" if refused else ""
