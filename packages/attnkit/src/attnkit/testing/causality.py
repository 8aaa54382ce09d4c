"""The causality check: with ``causal=True`` no output depends on the future."""

from __future__ import annotations

from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx, after, perturb


def check_causality(cfg: ConformanceConfig) -> None:
    """With ``causal=True``, perturbing q, k, v at positions >= t changes no output at positions < t.

    Skipped for a spec that declares ``selection_sees_future`` (content-based
    selection over the whole sequence). Self-attention (L = L) for several t, without and with key padding when
    declared; with ``causal_cross`` also L != S (bottom-right aligned: query
    i sees keys ``j <= i + S - L``) in both directions, and the long length.
    Compared in float64 where declared.
    """
    c = Ctx("causality", cfg)
    if not c.caps.causal:
        c.skip("the spec does not declare causal (its refusal is tested by 'refusals')")
    if getattr(c.caps, "selection_sees_future", False):
        c.skip("the spec declares selection_sees_future: no query attends a later key, but which earlier keys it "
               "attends is chosen from the whole sequence, so a later token may change an earlier output")
    dt = c.precise()
    attn = c.build(dtype=dt)
    cases = c.cases(attn, ["plain", "padding", "cross", "long"], causal_modes=[True])
    for n, case in enumerate(cases):
        L, S = case.L, case.S
        q, k, v = c.inputs(L, S, dt, seed_offset=n)
        label = case.describe(dt)
        base = c.call(attn, label, q, k, v, **case.kwargs(dt))
        cuts = sorted({t for t in (1, L // 2, L - 1) if 1 <= t + S - L <= S - 1 and 1 <= t < L})
        for t in cuts:
            kt = t + S - L  # the first key position query t - 1 cannot see
            q2 = perturb(q, after(L, t, c.device), seed=100 + t)
            k2 = perturb(k, after(S, kt, c.device), seed=200 + t)
            v2 = perturb(v, after(S, kt, c.device), seed=300 + t)
            out = c.call(attn, label, q2, k2, v2, **case.kwargs(dt))
            c.close(out[:, :, :t], base[:, :, :t],
                    f"{label}: perturbing queries at positions >= {t} and keys/values at positions >= {kt} "
                    f"changed outputs at positions < {t}, so the implementation leaks the future "
                    f"({DTYPE_NAMES[dt]})", dtype=dt, what="past outputs", against="unperturbed")
