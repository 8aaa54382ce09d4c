"""Checks of the tensor contract itself: shapes, dtypes, cross-attention, batch independence, determinism."""

from __future__ import annotations

import torch

from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx, perturb


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
