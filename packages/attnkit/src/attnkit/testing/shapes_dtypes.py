"""Checks of the tensor contract itself: shapes, dtypes, strided layouts, cross-attention, batch independence,
determinism."""

from __future__ import annotations

import torch

from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx, grad_names, perturb


def check_shapes_dtypes(cfg: ConformanceConfig) -> None:
    """Output shape ``(B, H, L, E)`` (with E != D), dtype and device of the input, finite, inputs untouched.

    For every tested dtype and every declared causal mode, on self-attention
    inputs of ``shapes`` (L = 9 by default: a multiple of no block size).
    """
    c = Ctx("shapes_dtypes", cfg)
    for dt in c.dtypes():
        attn = c.build(dtype=dt)
        q, k, v = c.inputs(c.L, c.L, dt)
        before = [t.clone() for t in (q, k, v)]
        for case in c.cases(attn, ["plain"]):
            label = case.describe(dt)
            out = c.call(attn, label, q, k, v, **case.kwargs(dt))
            if out.dtype != dt:
                c.fail(f"{label}: output dtype {out.dtype}, expected the input dtype {dt}")
            if out.device != q.device:
                c.fail(f"{label}: output on {out.device}, expected the input device {q.device}")
            c.finite(out, label, "output")
        for name, t, b in zip("qkv", (q, k, v), before):
            if not torch.equal(t, b):
                c.fail(f"dtype={DTYPE_NAMES[dt]}: forward modified its input {name} in place")


def check_layouts(cfg: ConformanceConfig) -> None:
    """Strided inputs give what contiguous ones give, output and gradients (to the dtype's tolerance), on each
    backend that runs here: q, k, v made as ``(B, L, H, D)`` and transposed to ``(B, H, L, D)`` (what a layer's
    ``view`` and ``transpose`` hand over: not contiguous), and k, v of one head expanded over the H heads (stride
    0 along H: a multi-query or grouped-query layer), each against the same values contiguous. A kernel that
    reads memory as if it were contiguous fails here. The precise dtype, eval mode, the last declared causal
    mode, with and without key padding; gradients on backends that train.
    """
    c = Ctx("layouts", cfg)
    dt = c.precise()
    runnable, _ = c.backends()
    for backend in runnable:
        attn = c.build(dtype=dt, backend=backend)
        for n, case in enumerate(c.cases(attn, ["plain", "padding"], causal_modes=c.causal_modes()[-1:])):
            q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
            kw = case.kwargs(dt)
            label = case.describe(dt) + ("" if backend is None else f", backend={backend!r}")
            forms = {"q, k, v transposed from (B, L, H, D)": ((q, k, v), _transposed),
                     "k, v of one head expanded over the heads (stride 0)": ((q, k[:, :1], v[:, :1]), _expanded)}
            for form, (values, lay) in forms.items():
                results = []
                for strided in (False, True):
                    leaves = [t.clone().requires_grad_(c.trains(backend)) for t in values]
                    args = lay(*leaves, c.H)
                    if not strided:
                        args = tuple(t.contiguous() for t in args)
                    out = c.call(attn, f"{label}, {form}", *args, grad=c.trains(backend), **kw)
                    got = c.grads(attn, out, leaves, f"{label}, {form}", 950 + n) if c.trains(backend) else []
                    results.append((out, got))
                (want, want_g), (out, got_g) = results
                c.close(out, want, f"{label}, {form}", dtype=dt, against="the same values contiguous")
                for which, a, b in zip(grad_names(attn), got_g, want_g):
                    if (a is None) != (b is None):
                        c.fail(f"{label}, {form}: the gradient of {which} is "
                               f"{'None' if a is None else 'a tensor'} with strided inputs, "
                               f"{'None' if b is None else 'a tensor'} with contiguous ones")
                    if a is not None:
                        c.close(a, b, f"{label}, {form}", dtype=dt, what=f"gradient of {which}",
                                against="the same values contiguous")


def _transposed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """The same values as ``(B, L, H, D)`` tensors seen as ``(B, H, L, D)``: not contiguous."""
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))


def _expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """One head's k, v ``(B, 1, S, D)`` expanded over ``heads`` (stride 0 along H)."""
    return q, k.expand(-1, heads, -1, -1), v.expand(-1, heads, -1, -1)


def check_cross_attention(cfg: ConformanceConfig) -> None:
    """Declared cross-attention (L != S, both L < S and L > S) gives ``(B, H, L, E)``, finite, every dtype.

    ``causal=False`` when ``cross``; ``causal=True`` (bottom-right aligned)
    when ``causal_cross``; with and without key padding. Values are checked
    by 'reference'; this check makes a declared L != S work at all.
    """
    c = Ctx("cross_attention", cfg)
    if not (c.caps.cross and c.caps.noncausal) and not c.caps.causal_cross:
        c.skip("the spec declares neither cross nor causal_cross (their refusal is tested by 'refusals')")
    for dt in c.dtypes():
        attn = c.build(dtype=dt)
        for n, case in enumerate(c.cases(attn, ["cross"])):
            q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
            label = case.describe(dt)
            out = c.call(attn, label, q, k, v, **case.kwargs(dt))
            if out.dtype != dt:
                c.fail(f"{label}: output dtype {out.dtype}, expected {dt}")
            c.finite(out, label, "output")


def check_batch_independence(cfg: ConformanceConfig) -> None:
    """Batch elements do not interact: perturbing batch 1's q, k, v leaves batch 0's output unchanged."""
    c = Ctx("batch_independence", cfg)
    dt = c.precise()
    attn = c.build(dtype=dt)
    q, k, v = c.inputs(c.L, c.L, dt)
    sel = (torch.arange(c.B, device=c.device) == 1)[:, None, None, None]
    q2, k2, v2 = (perturb(t, sel, seed=900 + i) for i, t in enumerate((q, k, v)))
    for case in c.cases(attn, ["plain"]):
        label = case.describe(dt)
        base = c.call(attn, label, q, k, v, **case.kwargs(dt))
        out = c.call(attn, label, q2, k2, v2, **case.kwargs(dt))
        c.close(out[0], base[0], f"{label}: perturbing batch element 1 changed the output of batch element 0",
                dtype=dt, against="unperturbed")


def check_determinism(cfg: ConformanceConfig) -> None:
    """Determinism under a seed: two instances built after ``torch.manual_seed(seed)`` give identical
    outputs, and one instance called twice in eval mode gives identical outputs (exactly, on CPU)."""
    c = Ctx("determinism", cfg)
    dt = c.precise()
    a1 = c.build(dtype=dt, seed=cfg.seed)
    a2 = c.build(dtype=dt, seed=cfg.seed)
    q, k, v = c.inputs(c.L, c.L, dt)
    for case in c.cases(a1, ["plain"]):
        label = case.describe(dt)
        first = c.call(a1, label, q, k, v, **case.kwargs(dt))
        torch.rand(3)  # advance the global RNG between calls
        again = c.call(a1, label, q, k, v, **case.kwargs(dt))
        c.close(again, first, f"{label}: the same instance gave a different output on a second call "
                "(eval mode)", dtype=dt, against="first call", **c.exact())
        other = c.call(a2, label, q, k, v, **case.kwargs(dt))
        c.close(other, first, f"{label}: two instances built after torch.manual_seed({cfg.seed}) disagree",
                dtype=dt, against="first instance", **c.exact())
