"""The backends check: every declared backend that can run here agrees with the ``torch`` path."""

from __future__ import annotations

import torch

from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx


def check_backends(cfg: ConformanceConfig) -> None:
    """Every declared backend that can run here agrees with the ``torch`` path, forward and backward.

    Each backend is forced with ``backend=NAME`` (availability from
    :func:`attnkit.backends.why_unavailable` with ``forced=True``: triton on
    CPU only under ``TRITON_INTERPRET=1``); the torch instance's state_dict is
    loaded into it. Forward in every tested dtype over the case generator's
    cases (2x tolerance in float16/bfloat16); gradients of q, k, v in
    float32/float64 (10x tolerance) unless the backend is forward-only.
    Needs no reference, so it also covers mechanisms without one. Skipped
    when only ``torch`` is declared or none of the others can run.
    """
    c = Ctx("backends", cfg)
    others = [b for b in c.caps.backends if b != "torch"]
    if not others:
        c.skip("the spec declares only the torch backend")
    if "backend" not in c.takes:
        c.fail(f"the spec declares backends {list(c.caps.backends)}, but its factory takes no backend= "
               "option, so they cannot be forced (pass backend through to attnkit.Attention.__init__)")
    runnable, unavailable = c.backends()
    ran = [b for b in runnable if b != "torch"]
    for backend in ran:
        for dt in c.dtypes():
            dname = DTYPE_NAMES[dt]
            ref_attn = c.build(dtype=dt, backend="torch")
            attn = c.build(dtype=dt, backend=backend)
            attn.load_state_dict(ref_attn.state_dict())
            factor = 1.0 if dt in (torch.float32, torch.float64) else 2.0
            with_grad = dt in c.float_dtypes() and c.trains(backend)
            for n, case in enumerate(c.cases(attn)):
                label = f"backend={backend!r} vs 'torch', {case.label}, L={case.L}, S={case.S}, dtype={dname}"
                q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n, requires_grad=with_grad)
                want = c.call(ref_attn, label, q, k, v, grad=with_grad, **case.kwargs(dt))
                got = c.call(attn, label, q, k, v, grad=with_grad, **case.kwargs(dt))
                atol, rtol = c.tol(dt, factor)
                c.close(got, want, label, dtype=dt, atol=atol, rtol=rtol, against="torch backend")
                if not with_grad:
                    continue
                g_want = c.grads(ref_attn, want, (q, k, v), label, seed=1100 + n)
                g_got = c.grads(attn, got, (q, k, v), label, seed=1100 + n)
                for name, a, b in zip("qkv", g_got, g_want):
                    if (a is None) != (b is None):
                        c.fail(f"{label}: the gradient of {name} is {'missing' if a is None else 'present'} "
                               f"on {backend!r} but {'missing' if b is None else 'present'} on 'torch'")
                    if a is not None:
                        c.close(a, b, label, dtype=dt, what=f"gradient of {name}", atol=atol * 10,
                                rtol=rtol * 10, against="torch backend")
    if not ran:
        c.skip("no backend besides torch can run here: " + "; ".join(unavailable))
