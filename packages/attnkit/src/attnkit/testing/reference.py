"""Correctness: agreement with the spec's own reference (``reference``); the "error vs softmax" figure.

``reference`` is the correctness test of every mechanism that names a
reference (``AttentionSpec.reference``; exact specs default to softmax's):
the same module, the same inputs, the same resolved mask object, float64,
forward and gradients, on every backend that can run here.

``error_bound`` only reports how far a mechanism is from softmax attention
on a stated distribution and fails when a *declared* ``error_bound`` is
exceeded; it is never the correctness test.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from ..reference import reference_attention
from .cases import Case
from .config import DTYPE_NAMES, DTYPES, ConformanceConfig
from .context import Ctx, grad_names, make_inputs


def _float64_copy(attn: Any) -> Any:
    """A float64 copy of ``attn`` (the same parameter and buffer values, upcast; ``attn`` is left as it is)."""
    return copy.deepcopy(attn).to(torch.float64)


def _reference(c: Ctx, ref: Any, attn: Any, label: str, q: Tensor, k: Tensor, v: Tensor, case: Case,
               grad: bool) -> Tensor:
    """``ref(attn, q, k, v, mask=<resolved>, positions=...)``; a failure when it raises or misshapes."""
    __tracebackhide__ = True
    try:
        with torch.set_grad_enabled(grad):
            want = ref(attn, q, k, v, mask=case.mask(torch.float64), positions=case.kw.get("positions"))
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: the spec's reference {c.spec.reference_path!r} raised {type(exc).__name__}: {exc}")
    shape = (*q.shape[:3], v.shape[-1])
    if not isinstance(want, Tensor) or tuple(want.shape) != shape:
        got = tuple(want.shape) if isinstance(want, Tensor) else type(want).__name__
        c.fail(f"{label}: the spec's reference returned {got}, expected (B, H, L, E) = {shape}")
    return want


def check_reference(cfg: ConformanceConfig) -> None:
    """The implementation equals its spec's reference, forward and gradients, on every backend here.

    ``reference = spec.load_reference()`` (softmax's for an exact spec without
    one) is called as ``reference(attn, q, k, v, *, mask, positions)`` with the
    float64 module (same seed, same options, same backend; for another dtype a
    float64 copy of the module under test, so both read the same rounded
    parameters), float64 inputs and the resolved mask object
    (:func:`attnkit.masks.resolve`). Cases: the whole
    case generator (causal modes, with and without key padding, ``attn_mask``,
    sliding window / document / function / union masks, cross, the long
    length) as declared, and a non-default ``scale`` when the factory takes one.
    Every declared backend that can run here is forced (``backend=NAME``).
    float64: forward and gradients of q, k, v and parameters (float32
    gradients at 10x when float64 is not declared); other dtypes: forward
    against the float64 reference at their own tolerance.
    """
    c = Ctx("reference", cfg)
    try:
        ref = c.spec.load_reference()
    except Exception as exc:  # noqa: BLE001
        c.fail(f"importing the spec's reference {c.spec.reference_path!r} raised {type(exc).__name__}: {exc}")
    if ref is None:
        c.skip("the spec names no reference (AttentionSpec.reference=None and exact=False); its distance to "
               "softmax attention is reported by 'error_bound'")
    f64 = torch.float64
    grad_dt = f64 if "float64" in c.caps.dtypes else torch.float32
    backends, _ = c.backends()
    for backend in backends:
        built64 = c.build(dtype=f64, backend=backend)
        cases = c.cases(built64)
        for dt in c.dtypes():
            attn = built64 if dt == f64 else c.build(dtype=dt, backend=backend)
            # the module the reference reads, in float64: for another dtype, a float64 copy of the module under
            # test, so both read the same (rounded) parameters and buffers; otherwise a learned discrete choice
            # (top-k edges, buckets) can flip on the parameters' rounding alone, which is no defect
            ref_attn = built64 if dt == f64 else _float64_copy(attn)
            with_grad = dt == grad_dt and c.trains(backend)
            for n, case in enumerate(cases):
                label = case.describe(dt, **({"backend": backend} if backend else {}))
                q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n, requires_grad=with_grad)
                out = c.call(attn, label, q, k, v, grad=with_grad, **case.kwargs(dt))
                q64, k64, v64 = (t.detach().to(f64).requires_grad_(with_grad) for t in (q, k, v))
                want = _reference(c, ref, ref_attn, label, q64, k64, v64, case, grad=with_grad)
                c.close(out, want, label, dtype=dt, against="reference")
                if not with_grad:
                    continue
                got_g = c.grads(attn, out, (q, k, v), label, seed=1500 + n)
                want_g = c.grads(ref_attn, want, (q64, k64, v64), f"{label} (the reference)", seed=1500 + n)
                factor = 1.0 if dt == f64 else 10.0
                atol, rtol = c.tol(dt, factor)
                for name, a, b in zip(grad_names(attn), got_g, want_g):
                    like = a if a is not None else b
                    if like is None:
                        continue
                    a = torch.zeros_like(like) if a is None else a
                    b = torch.zeros_like(like) if b is None else b
                    c.close(a, b, label, dtype=dt, what=f"gradient of {name}", atol=atol, rtol=rtol,
                            against="reference")
        if "scale" in c.takes and "scale" not in cfg.options:
            scaled = c.build(dtype=f64, backend=backend, scale=0.37)
            case = c.cases(scaled, ["plain"])[0]
            dt = f64 if "float64" in c.caps.dtypes else c.precise()
            mod = scaled if dt == f64 else c.build(dtype=dt, backend=backend, scale=0.37)
            label = case.describe(dt, **({"backend": backend} if backend else {})) + ", built with scale=0.37"
            q, k, v = c.inputs(c.L, c.L, dt, seed_offset=99)
            out = c.call(mod, label, q, k, v, **case.kwargs(dt))
            ref_mod = scaled if dt == f64 else _float64_copy(mod)
            want = _reference(c, ref, ref_mod, label, *(t.to(f64) for t in (q, k, v)), case, grad=False)
            c.close(out, want, label, dtype=dt, against="reference")


def check_error_bound(cfg: ConformanceConfig) -> str:
    """Reports the error vs softmax attention; fails only when a declared ``error_bound`` is exceeded.

    A figure, not the correctness test ('reference' is). See
    :class:`~attnkit.testing.ErrorDistribution` (default: q, k, v i.i.d.
    N(0, 1), B=2, H=2, L=S=64, D=E=16, seed 0, float32; default options plus
    the configured ones; relative Frobenius error of the whole output against
    float64 softmax attention), for each declared causal mode.
    """
    c = Ctx("error_bound", cfg)
    spec = c.spec
    if spec.exact:
        c.skip("the spec is exact; it is held to its reference by 'reference'")
    if spec.error_bound is None:
        c.skip("the spec declares no error_bound (error_bound=None: it claims no bound against softmax attention)")
    dist = cfg.error_distribution
    dname = dist.dtype if dist.dtype in c.caps.dtypes else DTYPE_NAMES[c.precise()]
    dt = DTYPES[dname]
    attn = c.build(dtype=dt, heads=dist.heads, head_dim=dist.dim, seed=dist.seed)
    q, k, v = make_inputs(dist.batch, dist.heads, dist.length, dist.length, dist.dim, dist.dim, dtype=dt,
                          device=c.device, seed=dist.seed, std=dist.std)
    figures = []
    for causal in c.causal_modes():
        case = f"causal={causal}, {dist.describe(dname)}"
        out = c.call(attn, case, q, k, v, causal=causal)
        c.finite(out, case, "output")
        ref = reference_attention(q, k, v, causal=causal)
        err = (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()
        if not err <= spec.error_bound:
            c.fail(f"{case}: relative Frobenius error {err:.4g} vs float64 softmax attention exceeds the "
                   f"declared error_bound {spec.error_bound:g} (options {dict(cfg.options)})")
        figures.append(f"causal={causal}: {err:.3g}")
    return f"error vs softmax {', '.join(figures)} (declared bound {spec.error_bound:g}; {dist.describe(dname)})"
