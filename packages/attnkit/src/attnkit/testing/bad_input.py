"""What bad or unusual inputs get: refusals, empty sequences, garbage at padded keys, NaN queries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import masks as _masks
from ..errors import UnsupportedFeatureError
from ..spec import KNOWN_DTYPES
from .cases import document_ids, function_mask, union_mask, window_mask
from .config import DTYPE_NAMES, DTYPES, ConformanceConfig
from .context import Ctx


def check_refusals(cfg: ConformanceConfig) -> None:
    """Every capability the spec lacks is refused with :class:`~attnkit.errors.UnsupportedFeatureError`.

    Covers causal, noncausal, key_padding_mask, attn_mask, each undeclared
    mask kind (sliding window, document, function, union), cross (L != S),
    causal cross, ``positions=``, streaming (``init_state``, ``step``,
    ``forward(return_state=True)``), lengths beyond the instance's limits and
    undeclared dtypes. The error must name the implementation. Skipped when
    the spec declares everything.
    """
    c = Ctx("refusals", cfg)
    caps = c.caps
    dt = c.precise()
    attn = c.build(dtype=dt)
    q, k, v = c.inputs(c.L, c.L, dt)
    qx, kx, vx = c.inputs(c.L, c.S, dt, seed_offset=1)
    mode = not caps.noncausal  # a causal mode the implementation accepts
    tried: list[str] = []

    def refused(label: str, lacking: str, fn: Callable[[], Any]) -> None:
        tried.append(label)
        try:
            with torch.no_grad():
                fn()
        except UnsupportedFeatureError as exc:
            if c.spec.name not in str(exc):
                c.fail(f"{label}: the UnsupportedFeatureError does not name the implementation: {exc}")
            return
        except Exception as exc:  # noqa: BLE001
            c.fail(f"{label}: the spec does not declare {lacking}, and the call raised {type(exc).__name__}: "
                   f"{exc}; it must raise attnkit.errors.UnsupportedFeatureError")
        c.fail(f"{label}: the spec does not declare {lacking}, yet the call was accepted silently; "
               "it must raise attnkit.errors.UnsupportedFeatureError (nothing is ever silently ignored)")

    if not caps.causal:
        refused("forward(causal=True)", "causal", lambda: attn(q, k, v, causal=True))
    if not caps.noncausal:
        refused("forward(causal=False)", "noncausal", lambda: attn(q, k, v, causal=False))
    if not caps.key_padding_mask:
        kpm = torch.ones(c.B, c.L, dtype=torch.bool, device=c.device)
        refused("forward(key_padding_mask=...)", "key_padding_mask",
                lambda: attn(q, k, v, causal=mode, key_padding_mask=kpm))
    if not caps.attn_mask and "tensor" not in caps.mask_kinds:
        m = torch.ones(c.L, c.L, dtype=torch.bool, device=c.device)
        refused("forward(attn_mask=...)", "attn_mask", lambda: attn(q, k, v, causal=mode, attn_mask=m))
    objects = {"sliding_window": window_mask(), "document": _masks.document(document_ids(c.B, c.L, c.device)),
               "function": function_mask(), "union": union_mask()}
    for kind, m in objects.items():
        if kind not in caps.mask_kinds:
            refused(f"forward(mask={m!r})", f"the mask kind {kind!r}",
                    lambda m=m: attn(q, k, v, causal=mode, mask=m))
    if not caps.cross and caps.noncausal:
        refused(f"forward(causal=False) with L={c.L} != S={c.S}", "cross", lambda: attn(qx, kx, vx, causal=False))
    if caps.causal and not caps.causal_cross:
        refused(f"forward(causal=True) with L={c.L} != S={c.S}", "causal_cross",
                lambda: attn(qx, kx, vx, causal=True))
    if not caps.positions:
        refused("forward(positions=0)", "positions", lambda: attn(q, k, v, causal=mode, positions=0))
    if caps.streaming is None:
        refused("init_state(B)", "streaming", lambda: attn.init_state(c.B, device=c.device, dtype=dt))
        refused("step(q, k, v, state)", "streaming", lambda: attn.step(q, k, v, {}))
        refused("forward(..., return_state=True)", "streaming",
                lambda: attn(q, k, v, causal=mode, return_state=True))
    lim = attn.limits
    for n, why in ((lim.max_length, "max_length"), (lim.length_multiple, "length_multiple")):
        if n is not None and n + 1 <= 1024 and (why == "max_length" or n > 1):
            ql, kl, vl = c.inputs(n + 1, n + 1, dt, seed_offset=2)
            refused(f"forward with L = S = {n + 1} ({why} {n})", f"L = {n + 1}",
                    lambda ql=ql, kl=kl, vl=vl: attn(ql, kl, vl, causal=mode))
    for name in KNOWN_DTYPES:
        if name not in caps.dtypes:
            qd, kd, vd = (t.to(DTYPES[name]) for t in (q, k, v))
            refused(f"forward with {name} inputs", f"dtype {name}",
                    lambda qd=qd, kd=kd, vd=vd: attn(qd, kd, vd, causal=mode))
    if not tried:
        c.skip("the spec declares every capability the kit can refuse-test (causal, noncausal, key padding, "
               "attn_mask, every mask kind, cross, causal_cross, positions, streaming, all dtypes, no limits)")


def check_empty_sequences(cfg: ConformanceConfig) -> None:
    """L = 0, S = 0 and B = 0 on every backend: empty in, empty out; S = 0 gives zeros ``(B, H, L, E)``;
    backward works.

    L = S = 0 in every causal mode (with an empty key padding mask when
    declared); with ``cross`` (non-causal) or ``causal_cross`` also L > 0, S = 0
    and L = 0, S > 0; an empty batch (B = 0, L = S > 0: the last batch of a filtered
    loader) in every causal mode, also in training mode. Gradients of the inputs are
    None or zeros; floating buffers stay finite (a batch statistic of nothing is NaN).
    """
    c = Ctx("empty_sequences", cfg)
    dt = c.precise()
    backends, _ = c.backends()
    for backend in backends:
        attn = c.build(dtype=dt, backend=backend)
        shapes = [(c.B, 0, 0, causal) for causal in c.causal_modes()]
        for causal in c.causal_modes():
            if c.caps.causal_cross if causal else c.caps.cross:
                shapes += [(c.B, c.L, 0, causal), (c.B, 0, c.S, causal)]
        shapes += [(0, c.L, c.L, causal) for causal in c.causal_modes()]
        for n, (B, L, S, causal) in enumerate(shapes):
            for padded in ([False, True] if c.caps.key_padding_mask else [False]):
                kw: dict[str, Any] = {"causal": causal}
                if padded:
                    kw["key_padding_mask"] = torch.ones(B, S, dtype=torch.bool, device=c.device)
                label = (f"{'backend=' + repr(backend) + ', ' if backend else ''}causal={causal}, B={B}, L={L}, "
                         f"S={S}, dtype={DTYPE_NAMES[dt]}{f', key_padding_mask=<({B}, {S})>' if padded else ''}")
                trains = c.trains(backend)
                q, k, v = c.inputs(L, S, dt, seed_offset=n, B=B, requires_grad=trains)
                attn.train(B == 0 and trains)
                out = c.call(attn, label + (", training mode" if attn.training else ""), q, k, v, grad=trains, **kw)
                attn.eval()
                for name, buf in attn.named_buffers():
                    if buf.is_floating_point() and not bool(torch.isfinite(buf).all()):
                        c.fail(f"{label}: the call left buffer {name!r} non-finite")
                if out.dtype != dt:
                    c.fail(f"{label}: output dtype {out.dtype}, expected {dt}")
                if S == 0 and out.numel() and bool((out != 0).any()):
                    c.fail(f"{label}: with no keys every output row must be 0, got max |out| = "
                           f"{out.detach().abs().max().item():.3g}")
                if not trains:
                    continue
                try:
                    g = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), allow_unused=True)
                except RuntimeError as exc:
                    if "does not require grad" in str(exc) and not out.requires_grad:
                        continue  # the output is a constant: nothing to differentiate
                    c.fail(f"{label}: backward raised {type(exc).__name__}: {exc}")
                except Exception as exc:  # noqa: BLE001
                    c.fail(f"{label}: backward raised {type(exc).__name__}: {exc}")
                for name, t, x in zip("qkv", g, (q, k, v)):
                    if t is not None and (t.shape != x.shape or bool((t != 0).any())):
                        c.fail(f"{label}: the gradient of {name} must be None or zeros of shape "
                               f"{tuple(x.shape)}, got shape {tuple(t.shape)} with max |grad| "
                               f"{t.abs().max().item() if t.numel() else 0:.3g}")


def check_padded_values(cfg: ConformanceConfig) -> None:
    """Garbage at padded keys changes nothing, on every backend: 1e4, -1e4, NaN, +inf, -inf.

    k and v at padded positions (end/middle padding, every causal mode, self
    and cross as declared) are filled with each value; every output and the
    gradient of q must equal those of the same call with ordinary values
    there (bitwise on CPU), and the gradients of k and v must be finite and 0
    at padded positions.
    """
    c = Ctx("padded_values", cfg)
    if not c.caps.key_padding_mask:
        c.skip("the spec does not declare key_padding_mask (its refusal is tested by 'refusals')")
    dt = c.precise()
    backends, _ = c.backends()
    for backend in backends:
        attn = c.build(dtype=dt, backend=backend)
        trains = c.trains(backend)
        cases = [cs for cs in c.cases(attn, ["padding", "cross"]) if cs.key_padding_mask is not None]
        for n, case in enumerate(cases):
            label = case.describe(dt, **({"backend": backend} if backend else {}))
            q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n, requires_grad=trains)
            base = c.call(attn, label, q, k, v, grad=trains, **case.kwargs(dt))
            gq = c.grads(attn, base, (q,), label, seed=1700 + n)[0] if trains else None
            pad = ~case.key_padding_mask[:, None, :, None]
            for fill in (1e4, -1e4, float("nan"), float("inf"), float("-inf")):
                what = f"{label}, padded k and v = {fill}"
                k2 = k.detach().masked_fill(pad, fill).requires_grad_(trains)
                v2 = v.detach().masked_fill(pad, fill).requires_grad_(trains)
                out = c.call(attn, what, q, k2, v2, grad=trains, **case.kwargs(dt))
                c.close(out, base, f"{what}: values at padded keys changed the output", dtype=dt,
                        against="ordinary padded values", **c.exact())
                if not trains:
                    continue
                g = c.grads(attn, out, (q, k2, v2), what, seed=1700 + n)
                c.close(g[0], gq, f"{what}: values at padded keys changed the gradient of q", dtype=dt,
                        what="gradient of q", against="ordinary padded values", **c.exact())
                for name, t in (("k", g[1]), ("v", g[2])):
                    c.finite(t, what, f"gradient of {name}")
                    if t is not None and bool((t.masked_select(pad.expand_as(t)) != 0).any()):
                        c.fail(f"{what}: the gradient of {name} at padded keys must be 0")


def check_nan_queries(cfg: ConformanceConfig) -> None:
    """A NaN query gives NaN in its own output row only (NaN in, NaN out); every other row is unchanged.

    One query row (b=0, h=0, i=L//2) set to NaN, every causal mode, self and
    cross as declared, on every backend; the other rows equal the clean
    call's (bitwise on CPU). Skipped for mechanisms whose configuration says
    queries interact (``queries_interact=True``, or the spec's ``Capabilities.queries_interact``).
    """
    c = Ctx("nan_queries", cfg)
    if cfg.queries_interact:
        c.skip("configured with queries_interact=True: a query may influence other rows, so a NaN query may spread")
    if getattr(c.caps, "queries_interact", False):
        c.skip("the spec declares queries_interact: a query may influence other rows, so a NaN query may spread")
    dt = c.precise()
    backends, _ = c.backends()
    for backend in backends:
        attn = c.build(dtype=dt, backend=backend)
        for n, case in enumerate(cs for cs in c.cases(attn, ["plain", "cross"]) if cs.key_padding_mask is None):
            label = case.describe(dt, **({"backend": backend} if backend else {}))
            q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
            i = case.L // 2
            base = c.call(attn, label, q, k, v, **case.kwargs(dt))
            q2 = q.clone()
            q2[0, 0, i] = float("nan")
            what = f"{label}, query (b=0, h=0, i={i}) = NaN"
            out = c.call(attn, what, q2, k, v, **case.kwargs(dt))
            if not bool(torch.isnan(out[0, 0, i]).all()):
                c.fail(f"{what}: the output row of the NaN query must be NaN (NaN in, NaN out), got "
                       f"{out[0, 0, i].tolist()}")
            row = torch.zeros_like(out, dtype=torch.bool)
            row[0, 0, i] = True
            c.close(out.masked_fill(row, 0.0), base.masked_fill(row, 0.0),
                    f"{what}: other output rows changed (a NaN query must stay in its own row)", dtype=dt,
                    what="other rows", against="clean call", **c.exact())
