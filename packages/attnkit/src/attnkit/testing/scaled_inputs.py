"""Numerical safety of approximations: inputs of large norm (``scaled_inputs``).

Random-feature and kernel approximations are exponentials or ratios of sums
that under- or overflow when q and k have a large norm (an all-zero output
row is the classic symptom). ``scaled_inputs`` feeds the kit's inputs with q
and k multiplied by :data:`SCALES` and holds the implementation to its own
spec's reference there.
"""

from __future__ import annotations

import torch

from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx

#: factors q and k are multiplied by
SCALES = (10.0, 30.0, 100.0)
#: largest relative Frobenius error against the spec's reference (float64) at those scales; a spec whose
#: ``error_bound`` is smaller is held to that instead. Large-norm inputs amplify float32 rounding in the
#: exponents (a relative 1e-7 of exponents in the thousands), so this is looser than the kit's atol/rtol.
SCALED_RELATIVE_BOUND = 1e-2
#: reference rows smaller than this fraction of the largest output entry count as zero
NEGLIGIBLE = 1e-6


def check_scaled_inputs(cfg: ConformanceConfig) -> str:
    """Approximate specs: q, k scaled by 10, 30 and 100 give finite rows, none all zero, close to the reference.

    For each declared causal mode, the kit's self-attention inputs (N(0, 1),
    ``shapes``) with q and k multiplied by each of :data:`SCALES`, in float32
    where declared (else the precise dtype), on the default backend: the
    output is finite, no row is entirely zero where the reference's is not (negligible rows aside), and its
    relative Frobenius error against the spec's reference (float64 module and
    inputs, the same resolved mask; rounded to the tested dtype, so that entries
    that dtype cannot hold count as 0 and a reference entirely below its range
    asks for an all-zero output) is at most
    ``min(SCALED_RELATIVE_BOUND, spec.error_bound)``. Skipped for exact specs
    (the 'reference' check holds them to softmax) and specs naming no reference.
    Returns the worst error per scale as a note.
    """
    c = Ctx("scaled_inputs", cfg)
    spec = c.spec
    if spec.exact:
        c.skip("the spec is exact; large-norm inputs are covered by the 'reference' check against softmax")
    ref = spec.load_reference()
    if ref is None:
        c.skip("the spec names no reference to hold large-norm outputs to")
    bound = SCALED_RELATIVE_BOUND if spec.error_bound is None else min(SCALED_RELATIVE_BOUND, spec.error_bound)
    dt = torch.float32 if "float32" in c.caps.dtypes else c.precise()
    f64 = torch.float64
    attn = c.build(dtype=dt)
    ref_attn = attn if dt == f64 else c.build(dtype=f64)
    worst: dict[float, float] = {}
    for n, case in enumerate(c.cases(attn, ["plain"])):
        q0, k0, v = c.inputs(case.L, case.S, dt, seed_offset=n)
        for scale in SCALES:
            label = f"{case.describe(dt)}, q and k scaled by {scale:g}"
            q, k = q0 * scale, k0 * scale
            out = c.call(attn, label, q, k, v, **case.kwargs(dt))
            c.finite(out, label, "output")
            with torch.no_grad():
                want = ref(ref_attn, q.to(f64), k.to(f64), v.to(f64), mask=case.mask(f64),
                           positions=case.kw.get("positions"))
            # the reference as the tested dtype holds it: entries below its smallest subnormal are 0 there, and
            # a faithful implementation can only return 0 for them (an unnormalised kernel's output shrinks
            # with the inputs' norm until the whole reference leaves float32's range)
            want = want.to(dt).to(f64)
            # a row the reference gives as zero (a feature map that is 0 for that query, or an entry the dtype
            # cannot hold) or as negligible (below NEGLIGIBLE of the largest output entry, e.g. a gate
            # saturating to 1e-50) may be zero
            row = want.abs().amax(-1)
            zero = (out.abs().amax(-1) == 0) & (row > 0) & (row > NEGLIGIBLE * row.max())       # (B, H, L)
            if bool(zero.any()):
                c.fail(f"{label}: {int(zero.sum())} of {zero.numel()} output rows are all zeros where the spec's "
                       f"reference is not (first at (b, h, t) = {tuple(zero.nonzero()[0].tolist())}): the "
                       f"features under- or overflow ({DTYPE_NAMES[dt]})")
            norm = torch.linalg.vector_norm(want)
            if norm == 0:      # the whole reference is 0 in this dtype: so must the output be
                err = 0.0 if bool((out == 0).all()) else float("inf")
            else:
                err = (torch.linalg.vector_norm(out.to(f64) - want) / norm).item()
            if not err <= bound:
                c.fail(f"{label}: relative Frobenius error {err:.3g} against the spec's reference "
                       f"{spec.reference_path!r} (float64) exceeds {bound:g}")
            worst[scale] = max(worst.get(scale, 0.0), err)
    figures = ", ".join(f"x{s:g}: {e:.2g}" for s, e in worst.items())
    return f"relative error vs the reference with q, k scaled ({DTYPE_NAMES[dt]}): {figures} (bound {bound:g})"
