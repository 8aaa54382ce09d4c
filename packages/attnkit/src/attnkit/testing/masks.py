"""Mask checks: key padding, fully masked rows, ``attn_mask``, mask objects.

Since contract 2 the base class zeroes k and v at padded keys before an
implementation sees them, so "perturb the padded keys, compare" proves
nothing about padding any more. ``key_padding`` instead compares with the
output computed with the padded keys physically removed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import masks as _masks
from ..positions import Positions
from .cases import bool_to_additive, left_padding_mask, padding_mask, parity_mask
from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx, perturb


def check_key_padding(cfg: ConformanceConfig) -> None:
    """Padded keys are absent: the output equals attention over the unpadded keys only.

    * causal (when declared): row b pads its first ``1 + b % 3`` keys; the
      rows after the padding equal ``causal=True`` attention over the
      sequence with those positions cut off (batch element by element;
      ``positions=`` offset by the cut when the spec uses positions);
    * non-causal with ``cross``: padding at the end and in the middle, self
      (L keys) and cross (S keys); every row equals cross-attention of the
      same queries to the kept keys only;
    * k and v of padded keys get exactly zero gradient; an all-True mask
      equals no mask. Compared in float64 where declared.
    """
    c = Ctx("key_padding", cfg)
    if not c.caps.key_padding_mask:
        c.skip("the spec does not declare key_padding_mask (its refusal is tested by 'refusals')")
    dt = c.precise()
    attn = c.build(dtype=dt)
    pos = c.caps.positions
    setups: list[tuple[bool, int, int, Tensor]] = []
    if c.caps.causal:
        setups.append((True, c.L, c.L, left_padding_mask(c.B, c.L, c.device)))
    if c.caps.noncausal and c.caps.cross:
        setups += [(False, c.L, c.L, padding_mask(c.B, c.L, c.device)),
                   (False, c.L, c.S, padding_mask(c.B, c.S, c.device))]
    for n, (causal, L, S, kpm) in enumerate(setups):
        if attn.limits.why_not(L, S) is not None:
            continue
        q, k, v = c.inputs(L, S, dt, seed_offset=n)
        case = (f"causal={causal}, L={L}, S={S}, dtype={DTYPE_NAMES[dt]}, "
                f"key_padding_mask=<{'first keys' if causal else 'end/middle'} padded (B, S)>")
        out = c.call(attn, case, q, k, v, causal=causal, key_padding_mask=kpm)
        for b in range(c.B):
            keep = kpm[b].nonzero().flatten()
            qb, kb, vb = q[b:b + 1], k[b:b + 1, :, keep], v[b:b + 1, :, keep]
            kw: dict[str, Any] = {"causal": causal}
            if causal:  # left padding: cut the first p positions of queries and keys alike
                p = S - keep.numel()
                qb, rows = qb[:, :, p:], slice(p, None)
                if pos:
                    kw["positions"] = p
            else:
                rows = slice(None)
                if pos:
                    kw["positions"] = Positions(q=torch.arange(L, device=c.device) + S - L, k=keep)
            if attn.limits.why_not(qb.shape[2], kb.shape[2]) is not None:
                continue
            what = f"{case}: batch element {b} with its {S - keep.numel()} padded key(s) removed"
            want = c.call(attn, what, qb, kb, vb, **kw)
            hint = "" if pos else (" (an output that depends on token positions needs capabilities.positions, "
                                   "so the kit can give the kept keys their positions)")
            c.close(out[b:b + 1, :, rows], want, f"{what}: the padded output differs, so key_padding_mask is "
                    f"not honoured (True = real token; padded keys must count as absent, not as zero keys){hint}",
                    dtype=dt, against="keys removed")
    for n, causal in enumerate(c.causal_modes()):
        q, k, v = c.inputs(c.L, c.L, dt, seed_offset=10 + n, requires_grad=True)
        kpm = padding_mask(c.B, c.L, c.device)
        case = f"causal={causal}, L={c.L}, S={c.L}, dtype={DTYPE_NAMES[dt]}, key_padding_mask=<end/middle padded>"
        if c.trains(cfg.options.get("backend")):
            out = c.call(attn, case, q, k, v, grad=True, causal=causal, key_padding_mask=kpm)
            g = c.grads(attn, out, (q, k, v), case, seed=1200 + n)
            pad = ~kpm[:, None, :, None]
            for name, t in (("k", g[1]), ("v", g[2])):
                if t is not None and bool((t.detach().masked_select(pad.expand_as(t)) != 0).any()):
                    worst = t.detach().masked_select(pad.expand_as(t)).abs().max().item()
                    c.fail(f"{case}: the gradient of {name} at padded key positions must be exactly 0, got "
                           f"max |grad| = {worst:.3g}")
        ones = torch.ones_like(kpm)
        case1 = case.replace("<end/middle padded>", "<all True>")
        c.close(c.call(attn, case1, q, k, v, causal=causal, key_padding_mask=ones),
                c.call(attn, case1, q, k, v, causal=causal), f"{case1}: an all-True key_padding_mask changed "
                "the output", dtype=dt, against="no mask")


def check_fully_masked_rows(cfg: ConformanceConfig) -> None:
    """A query row that sees no key gives zeros (not NaN), and gradients stay finite.

    Cases, as declared: a batch row whose keys are all padded; causal with key
    0 padded (query 0 sees nothing); an ``attn_mask`` row that is all False
    (bool) or all -inf (float); a mask function hiding every key from query 2;
    ``causal_cross`` with L > S (the first L - S queries see nothing).
    Forward in every tested dtype (|out| <= atol), gradients of q, k, v and
    parameters in float32/float64.
    """
    c = Ctx("fully_masked_rows", cfg)
    caps = c.caps
    B, L, S = c.B, c.L, c.S
    kinds = set(caps.mask_kinds)
    row2 = torch.ones(L, L, dtype=torch.bool, device=c.device)
    row2[2] = False
    cases: list[tuple[str, int, int, dict[str, Any], Any]] = []
    if caps.key_padding_mask:
        kpm = torch.ones(B, L, dtype=torch.bool, device=c.device)
        kpm[1] = False
        for causal in c.causal_modes():
            cases.append((f"causal={causal}, key_padding_mask=<batch 1 all padded>", L, L,
                          {"causal": causal, "key_padding_mask": kpm}, lambda o: o[1]))
        if caps.causal:
            kpm0 = torch.ones(B, L, dtype=torch.bool, device=c.device)
            kpm0[0, 0] = False
            cases.append(("causal=True, key_padding_mask=<key 0 of batch 0 padded>", L, L,
                          {"causal": True, "key_padding_mask": kpm0}, lambda o: o[0, :, 0]))
    for causal in c.causal_modes():
        if "tensor" in kinds:
            cases.append((f"causal={causal}, attn_mask=<bool, row 2 all False>", L, L,
                          {"causal": causal, "attn_mask": row2}, lambda o: o[:, :, 2]))
            cases.append((f"causal={causal}, attn_mask=<float, row 2 all -inf>", L, L,
                          {"causal": causal, "attn_mask": "additive"}, lambda o: o[:, :, 2]))
        if "function" in kinds:
            m = _masks.from_function(lambda b, h, q, kv: q != 2, name="kit-blind-query-2")
            cases.append((f"causal={causal}, mask=from_function(q != 2)", L, L,
                          {"causal": causal, "mask": m}, lambda o: o[:, :, 2]))
    if caps.causal_cross:
        Lq, Sk = max(L, S), min(L, S)
        cases.append((f"causal=True, L={Lq} > S={Sk}", Lq, Sk, {"causal": True}, lambda o, n=Lq - Sk: o[:, :, :n]))
    if not cases:
        c.skip("no declared capability can produce a fully masked row "
               "(no key_padding_mask, attn_mask, mask function or causal_cross)")
    grad_dtypes = c.float_dtypes()
    for dt in c.dtypes():
        attn = c.build(dtype=dt)
        atol, _ = c.tol(dt)
        for n, (label, Lq, Sk, kw, rows) in enumerate(cases):
            if attn.limits.why_not(Lq, Sk) is not None:
                continue
            kw = dict(kw)
            if isinstance(kw.get("attn_mask"), str):
                kw["attn_mask"] = bool_to_additive(row2, dt)
            case = f"{label}, L={Lq}, S={Sk}, dtype={DTYPE_NAMES[dt]}"
            with_grad = dt in grad_dtypes
            q, k, v = c.inputs(Lq, Sk, dt, seed_offset=n, requires_grad=with_grad)
            out = c.call(attn, case, q, k, v, grad=with_grad, **kw)
            c.finite(out, case, "output")
            masked = rows(out).detach()
            worst = masked.abs().max().item() if masked.numel() else 0.0
            if not worst <= atol:
                c.fail(f"{case}: fully masked query rows must be 0, got max |out| = {worst:.3g} "
                       f"(tolerance {atol:.3g})")
            if with_grad:
                g = c.grads(attn, out, (q, k, v), case, seed=600 + n)
                names = ["q.grad", "k.grad", "v.grad"] + [f"grad of parameter {p}" for p, t
                                                          in attn.named_parameters() if t.requires_grad]
                for name, t in zip(names, g):
                    c.finite(t, case, name)


def check_attn_mask(cfg: ConformanceConfig) -> None:
    """A declared ``attn_mask`` is honoured: masked-out (query, key) pairs have no influence.

    The mask ``(B, H, L, S)`` lets query i of (b, h) see key j iff j = 0 or
    ``(i + b + h) % 2 == j % 2``; perturbing the keys/values j >= 1 of one
    parity must leave the rows that may not see them unchanged. Bool and additive
    (0 / -inf) forms agree, and an ``(L, S)`` mask equals its expansion.
    Every declared causal mode, self- and (when declared) cross-attention.
    """
    c = Ctx("attn_mask", cfg)
    if not c.caps.attn_mask and "tensor" not in c.caps.mask_kinds:
        c.skip("the spec does not declare attn_mask (its refusal is tested by 'refusals')")
    dt = c.precise()
    attn = c.build(dtype=dt)
    setups = [(c.L, c.L, causal) for causal in c.causal_modes()]
    if c.caps.cross and c.caps.noncausal:
        setups.append((c.L, c.S, False))
    B, H = c.B, c.H
    for n, (L, S, causal) in enumerate(setups):
        if attn.limits.why_not(L, S) is not None:
            continue
        q, k, v = c.inputs(L, S, dt, seed_offset=n)
        mask = parity_mask(B, H, L, S, c.device)
        dname = DTYPE_NAMES[dt]
        case = f"causal={causal}, L={L}, S={S}, dtype={dname}, attn_mask=<bool parity (B, H, L, S)>"
        base = c.call(attn, case, q, k, v, causal=causal, attn_mask=mask)
        c.finite(base, case, "output")
        j = torch.arange(S, device=c.device)[None, None, :, None]
        i_parity = ((torch.arange(L, device=c.device)[None, None, :] + torch.arange(B, device=c.device)
                     [:, None, None] + torch.arange(H, device=c.device)[None, :, None]) % 2)
        for p in (0, 1):
            keys = (j % 2 == p) & (j >= 1)
            k2 = perturb(k, keys, seed=700 + 2 * n + p)
            v2 = perturb(v, keys, seed=800 + 2 * n + p)
            out = c.call(attn, case, q, k2, v2, causal=causal, attn_mask=mask)
            blind = (i_parity != p)[..., None]  # rows that may not see parity-p keys
            c.close(torch.where(blind, out, base), base,
                    f"{case}: perturbing keys/values at {'even' if p == 0 else 'odd'} positions >= 1 changed "
                    "query rows the mask forbids from seeing them, so attn_mask is not honoured",
                    dtype=dt, what="rows that may not see them", against="unperturbed")
        case_f = case.replace("bool parity", "additive 0/-inf parity")
        c.close(c.call(attn, case_f, q, k, v, causal=causal, attn_mask=bool_to_additive(mask, dt)), base,
                f"{case_f}: the additive form of the mask disagrees with the bool form", dtype=dt,
                against="bool mask")
        m2 = mask[0, 0]
        case_b = case.replace("(B, H, L, S)", "(L, S)")
        c.close(c.call(attn, case_b, q, k, v, causal=causal, attn_mask=m2),
                c.call(attn, case_b, q, k, v, causal=causal, attn_mask=m2.expand(B, H, L, S).contiguous()),
                f"{case_b}: an (L, S) mask disagrees with the same mask expanded to (B, H, L, S)",
                dtype=dt, against="expanded mask")


def check_mask_objects(cfg: ConformanceConfig) -> None:
    """Mask objects (``mask=``) are honoured, without trusting any reference.

    * ``mask=causal()`` equals ``causal=True`` and ``mask=key_padding(kpm)``
      equals ``key_padding_mask=kpm`` (as declared);
    * for every declared sliding-window, document, function and union case of
      the case generator (each causal mode): perturbing the key and value at
      one position j (first, middle, last) leaves every query row the mask
      hides j from unchanged;
    * when ``tensor`` masks are declared too, ``mask=m`` equals
      ``attn_mask=<m materialised as a bool (B, H, L, S) tensor>``.
    """
    c = Ctx("mask_objects", cfg)
    dt = c.precise()
    attn = c.build(dtype=dt)
    q, k, v = c.inputs(c.L, c.L, dt)
    dname = DTYPE_NAMES[dt]
    ran = []
    if c.caps.causal:
        label = f"mask=causal() vs causal=True, L={c.L}, dtype={dname}"
        c.close(c.call(attn, label, q, k, v, mask=_masks.causal()), c.call(attn, label, q, k, v, causal=True),
                label, dtype=dt, against="causal=True")
        ran.append("causal")
    if c.caps.key_padding_mask:
        kpm = padding_mask(c.B, c.L, c.device)
        label = f"mask=key_padding(kpm) vs key_padding_mask=kpm, L={c.L}, dtype={dname}"
        mode = c.causal_modes()[0]
        c.close(c.call(attn, label, q, k, v, causal=mode, mask=_masks.key_padding(kpm)),
                c.call(attn, label, q, k, v, causal=mode, key_padding_mask=kpm), label, dtype=dt,
                against="key_padding_mask=")
        ran.append("key_padding")
    for n, case in enumerate(c.cases(attn, ["objects"])):
        label = case.describe(dt)
        q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
        kw = case.kwargs(dt)
        base = c.call(attn, label, q, k, v, **kw)
        m = case.mask(dt)
        geom = _masks.Geometry(c.B, c.H, case.L, case.S, c.device, None)
        keep = m.dense(geom).expand(c.B, c.H, case.L, case.S)
        for j in sorted({0, case.S // 2, case.S - 1}):
            at = (torch.arange(case.S, device=c.device) == j)[None, None, :, None]
            out = c.call(attn, label, q, perturb(k, at, 1300 + j), perturb(v, at, 1400 + j), **kw)
            blind = ~keep[..., j][..., None]
            c.close(torch.where(blind, out, base), base, f"{label}: perturbing the key and value at position {j} "
                    "changed query rows the mask hides it from, so the mask is not honoured", dtype=dt,
                    what="rows that may not see the key", against="unperturbed")
        if "tensor" in c.caps.mask_kinds:
            dense = c.call(attn, label, q, k, v, causal=case.causal, attn_mask=keep.contiguous())
            c.close(dense, base,
                    f"{label}: mask=<object> disagrees with the same mask materialised as a bool attn_mask",
                    dtype=dt, against="materialised attn_mask")
        ran.append(label)
    if not ran:
        c.skip("the spec declares no mask kind besides those 'causality', 'key_padding' and 'attn_mask' test")
