"""Property-based fuzzing of one registered attention (hypothesis): the ``fuzz`` check.

Each example draws a :class:`FuzzCase` from what the spec declares:

* shapes: ``B`` 1..3, ``H`` 1..2, ``L`` 0..9, ``S`` = L, or 0..9 when the spec
  declares cross-attention (``causal_cross`` for causal calls), head dims ``D``
  and ``E`` from 1, 2, 3, 5, 8, 16, 64 and 128 (small L keeps D = 128 cheap);
* a dtype among the declared ones, a causal mode among the declared ones;
* key padding (when ``key_padding`` is a declared mask kind): per batch row none,
  random, or the whole row padded; padded keys and values may hold NaN, ±inf or 1e4;
* a structured mask among the declared kinds: a sliding window, packed documents,
  a relative mask function, a random bool ``attn_mask``;
* options drawn from the spec's option schema (choices, bools, bounded ints and
  floats; ``backend`` and the configured options are left alone).

The module is built under the configured seed in eval mode. Every draw either
raises an attnkit error (:class:`attnkit.errors.AttnkitError`: a clear refusal)
or returns ``(B, H, L, E)`` that is finite (no NaN: the inputs the reference
sees are finite) and equals the spec's reference (float64, the same options
and seed) within the dtype's tolerance (for float32 draws, plus four times the
reference's own float32 error on the same inputs, element by element: the
draw's conditioning). Any other exception, a wrong shape, a
non-finite value or a disagreement fails the check; hypothesis shrinks it and
the failure message holds a one-line reproducer::

    attnkit.testing.fuzz.replay('NAME', FuzzCase(...))

Deterministic: ``derandomize=True``, no example database, :data:`DEFAULT_EXAMPLES`
examples (override with the environment variable ``ATTNKIT_FUZZ_EXAMPLES``, e.g.
1000 for a long local run). Skipped (with the reason) when hypothesis is not
installed (``pip install 'attnkit[testing]'``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import masks as _masks
from ..errors import AttnkitError
from .config import DTYPE_NAMES, DTYPES, CheckFailed, ConformanceConfig
from .context import Ctx, make_inputs, noise_like, shape_hints

__all__ = ["DEFAULT_EXAMPLES", "FuzzCase", "check_fuzz", "examples_budget", "replay", "run_case"]

#: Examples per mechanism in CI (a few seconds each on a 2-core machine).
DEFAULT_EXAMPLES = 12
HEAD_DIMS = (1, 2, 3, 5, 8, 16, 64, 128)
#: options never drawn: head geometry comes from the shapes; backends have their own check
NOT_DRAWN = {"num_heads", "head_dim", "backend"}
POISONS = (float("nan"), float("inf"), float("-inf"), 1e4)


def examples_budget() -> int:
    """``ATTNKIT_FUZZ_EXAMPLES`` when set (an int >= 1), else :data:`DEFAULT_EXAMPLES`."""
    raw = os.environ.get("ATTNKIT_FUZZ_EXAMPLES", "").strip()
    if not raw:
        return DEFAULT_EXAMPLES
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"ATTNKIT_FUZZ_EXAMPLES: expected an int >= 1, got {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class FuzzCase:
    """One drawn call, plain data only (its ``repr`` is the reproducer).

    Attributes:
        B, H, L, S, D, E: batch, heads, query length, key length, q/k head dim, value head dim.
        dtype: a dtype name (``"float32"``).
        causal: the ``causal=`` argument.
        options: build options drawn from the schema.
        padding: None, or per batch row a list of S bools (True = real key).
        poison: what padded keys and values hold (NaN, ±inf, 1e4), or None.
        mask: None, ``("window", before, after)``, ``("document", q_ids, kv_ids)``,
            ``("function", modulus)`` or ``("tensor", bits, shape)``.
        seed: the seed of the inputs.
    """

    B: int
    H: int
    L: int
    S: int
    D: int
    E: int
    dtype: str
    causal: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    padding: tuple[tuple[bool, ...], ...] | None = None
    poison: float | None = None
    mask: tuple | None = None
    seed: int = 0


def _relative(modulus: int):
    def fn(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q - kv) % modulus == 0

    return fn


def _mask_object(case: FuzzCase, device: torch.device | str = "cpu") -> Any:
    if case.mask is None:
        return None
    kind = case.mask[0]
    if kind == "window":
        return _masks.sliding_window(case.mask[1], case.mask[2])
    if kind == "document":
        return _masks.document(torch.tensor(case.mask[1], dtype=torch.long, device=device).view(case.B, case.L),
                               torch.tensor(case.mask[2], dtype=torch.long, device=device).view(case.B, case.S))
    if kind == "function":
        return _masks.from_function(_relative(case.mask[1]), name=f"fuzz-mod{case.mask[1]}")
    if kind == "tensor":
        return _masks.from_tensor(torch.tensor(case.mask[1], dtype=torch.bool, device=device).view(case.mask[2]))
    raise ValueError(f"unknown fuzz mask {case.mask!r}")


def _kwargs(case: FuzzCase, device: torch.device | str = "cpu") -> dict[str, Any]:
    kw: dict[str, Any] = {"causal": case.causal}
    if case.padding is not None:
        kw["key_padding_mask"] = torch.tensor(case.padding, dtype=torch.bool, device=device).view(case.B, case.S)
    mask = _mask_object(case, device)
    if mask is not None:
        kw["mask"] = mask
    return kw


def _option_strategy(st: Any, opt: Any) -> Any:
    """A strategy for one option of the schema, or None (left at its default)."""
    typ = str(opt.type).replace(" ", "")
    nullable = "|None" in typ or "Optional" in typ
    base = typ.replace("|None", "").replace("Optional[", "").rstrip("]") if nullable else typ
    if opt.choices:
        strat = st.sampled_from(list(opt.choices))
    elif base == "bool":
        strat = st.booleans()
    elif base == "int":
        lo = 0 if opt.minimum is None else math.floor(opt.minimum) + (1 if opt.exclusive_minimum else 0)
        hi = lo + 8 if opt.maximum is None else min(lo + 8, math.ceil(opt.maximum) - (1 if opt.exclusive_maximum
                                                                                      else 0))
        if hi < lo:
            return None
        strat = st.integers(lo, hi)
    elif base == "float":
        lo = 0.0 if opt.minimum is None else float(opt.minimum)
        hi = lo + 4.0 if opt.maximum is None else float(opt.maximum)
        if opt.exclusive_minimum or lo == 0.0:
            lo = lo + min(0.05, (hi - lo) / 4)
        if opt.exclusive_maximum or opt.maximum is not None:
            hi = hi - min(0.05, (hi - lo) / 4)
        strat = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    else:
        return None
    return st.one_of(st.none(), strat) if nullable else strat


def fuzz_cases(cfg: ConformanceConfig) -> Any:
    """The hypothesis strategy of :class:`FuzzCase` for ``cfg``'s spec."""
    from hypothesis import strategies as st

    caps = cfg.caps
    kinds = set(caps.mask_kinds or ())
    modes = [c for c, ok in ((False, caps.noncausal), (True, caps.causal)) if ok]
    dtypes = [n for n in (cfg.tested_dtypes() if hasattr(cfg, "tested_dtypes") else caps.dtypes)]
    try:
        schema = [o for o in cfg.spec.resolved_options() if o.name not in NOT_DRAWN and o.name not in cfg.options]
    except Exception:  # noqa: BLE001 - the build reports import problems
        schema = []
    option_strats = {o.name: s for o in schema if (s := _option_strategy(st, o)) is not None}

    @st.composite
    def draw(d: Any) -> FuzzCase:
        B, H = d(st.integers(1, 3)), d(st.integers(1, 2))
        causal = d(st.sampled_from(modes))
        L = d(st.integers(0, 9))
        cross_ok = caps.causal_cross if causal else caps.cross
        S = d(st.integers(0, 9)) if cross_ok and d(st.booleans()) else L
        D, E = d(st.sampled_from(HEAD_DIMS)), d(st.sampled_from(HEAD_DIMS))
        dtype = d(st.sampled_from(dtypes))
        options = {}
        for name in sorted(option_strats):
            if d(st.booleans()):
                options[name] = d(option_strats[name])
        padding = poison = None
        if "key_padding" in kinds and d(st.booleans()):
            rows = []
            for _ in range(B):
                how = d(st.sampled_from(["none", "random", "all"]))
                if how == "none":
                    rows.append((True,) * S)
                elif how == "all":
                    rows.append((False,) * S)
                else:
                    rows.append(tuple(d(st.lists(st.booleans(), min_size=S, max_size=S))))
            padding = tuple(rows)
            poison = d(st.sampled_from((None, *POISONS)))
        mask = None
        choices = [k for k in ("window", "document", "function", "tensor")
                   if ("sliding_window" if k == "window" else k) in kinds]
        if choices and d(st.booleans()):
            kind = d(st.sampled_from(choices))
            if kind == "window":
                mask = ("window", d(st.integers(0, 4)), d(st.integers(0, 4)))
            elif kind == "document":
                mask = ("document", tuple(d(st.lists(st.integers(0, 2), min_size=B * L, max_size=B * L))),
                        tuple(d(st.lists(st.integers(0, 2), min_size=B * S, max_size=B * S))))
            elif kind == "function":
                mask = ("function", d(st.integers(1, 3)))
            else:
                shape = (d(st.sampled_from([1, B])), d(st.sampled_from([1, H])), L, S)
                n = math.prod(shape)
                mask = ("tensor", tuple(d(st.lists(st.booleans(), min_size=n, max_size=n))), shape)
        return FuzzCase(B, H, L, S, D, E, dtype, causal, options, padding, poison, mask, d(st.integers(0, 2**16)))

    return draw()


def _build(cfg: ConformanceConfig, case: FuzzCase, dtype: torch.dtype) -> Any:
    """The module under ``torch.manual_seed(cfg.seed)`` (RNG forked), eval mode, on cfg.device in ``dtype``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        hints = shape_hints(cfg.spec, case.H, case.D, case.E)
        attn = cfg.registry.build_with_hints(cfg.name, hints, **{**cfg.options, **case.options})
    return attn.to(device=cfg.device, dtype=dtype).eval()


def run_case(cfg: ConformanceConfig, case: FuzzCase) -> str:
    """Run one drawn case; ``"refused"`` or ``"matched"``; raises :class:`CheckFailed` otherwise."""
    __tracebackhide__ = True
    c = Ctx("fuzz", cfg)
    dt, f64 = DTYPES[case.dtype], torch.float64
    label = "the drawn case"
    try:
        attn = _build(cfg, case, dt)
    except AttnkitError:
        return "refused"
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: building raised {type(exc).__name__}: {exc} (not an attnkit error)")
    q, k, v = make_inputs(case.B, case.H, case.L, case.S, case.D, case.E, dtype=dt, device=c.device,
                          seed=case.seed)
    kw = _kwargs(case, c.device)
    if case.poison is not None and case.padding is not None:
        pad = ~kw["key_padding_mask"][:, None, :, None]
        k, v = (torch.where(pad, torch.full_like(t, case.poison), t) for t in (k, v))
    try:
        with torch.no_grad():
            out = attn(q, k, v, **kw)
    except AttnkitError as exc:
        if not str(exc).strip():
            c.fail(f"{label}: refused with an empty {type(exc).__name__} message")
        return "refused"
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: forward raised {type(exc).__name__}: {exc} (not an attnkit error: a refusal must be "
               f"clear)")
    expected = (case.B, case.H, case.L, case.E)
    if not isinstance(out, Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        c.fail(f"{label}: output {got}, expected (B, H, L, E) = {expected}")
    c.finite(out, label, "output")
    if case.L == 0 or case.S == 0:  # known without a reference: nothing out, or no key (a fully masked row)
        c.close(out, torch.zeros(expected, dtype=f64), label, dtype=dt, against="zeros (no key to attend)")
        return "matched"
    ref = cfg.spec.load_reference()
    if ref is None:
        return "matched"
    ref_attn = attn if dt == f64 else _build(cfg, case, f64)
    q64, k64, v64 = make_inputs(case.B, case.H, case.L, case.S, case.D, case.E, dtype=dt, device=c.device,
                                seed=case.seed)
    resolved = _masks.resolve(kw.get("mask"), causal=case.causal, key_padding_mask=kw.get("key_padding_mask"))
    try:
        with torch.no_grad():
            want = ref(ref_attn, q64.to(f64), k64.to(f64), v64.to(f64), mask=resolved, positions=None)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: the module accepted the call but the spec's reference {cfg.spec.reference_path!r} "
               f"raised {type(exc).__name__}: {exc}")
    slack = None
    if dt != f64:  # conditioning: what the plain reference itself loses in this precision is allowed too
        try:
            with torch.no_grad():
                own = ref(attn, q64, k64, v64, mask=resolved, positions=None)
            slack = 4.0 * (own.to(f64) - want).abs()
        except Exception:  # noqa: BLE001 - a reference that cannot run in this dtype gives no allowance
            slack = None
    c.close(out, want, label, dtype=dt, against="reference", slack=slack,
            slack_why="4x the reference's own error in this dtype")
    if dt == f64 and case.poison is None and cfg.spec.capabilities.backends:
        _gradients(c, attn, ref, case, kw, resolved, (q64, k64, v64), label)
    return "matched"


def _gradients(c: Ctx, attn: Any, ref: Any, case: FuzzCase, kw: dict[str, Any], resolved: Any,
               inputs: tuple[Tensor, Tensor, Tensor], label: str) -> None:
    """float64 draws: the gradients of ``<out, noise>`` w.r.t. q, k, v equal the reference's."""
    __tracebackhide__ = True
    mine = [t.detach().clone().requires_grad_(True) for t in inputs]
    theirs = [t.detach().clone().requires_grad_(True) for t in inputs]
    def grads(out: Tensor, wrt: list[Tensor], noise: Tensor) -> tuple[Tensor | None, ...]:
        if not out.requires_grad:  # a constant output (e.g. every key padded): no gradient anywhere
            return (None, None, None)
        return torch.autograd.grad(out, wrt, noise, allow_unused=True)

    try:
        out = attn(*mine, **kw)
        noise = noise_like(out, case.seed + 1, scale=1.0)
        got = grads(out, mine, noise)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: backward raised {type(exc).__name__}: {exc}")
    want = grads(ref(attn, *theirs, mask=resolved, positions=None), theirs, noise)
    for name, a, b, like in zip("qkv", got, want, inputs, strict=True):
        a = torch.zeros_like(like) if a is None else a
        b = torch.zeros_like(like) if b is None else b
        c.close(a, b, label, dtype=torch.float64, what=f"gradient of {name}", against="reference")


def replay(name: str, case: FuzzCase, options: Mapping[str, Any] | None = None, **config: Any) -> str:
    """Re-run one case (the reproducer a failure prints); raises :class:`CheckFailed` as the check did."""
    return run_case(ConformanceConfig(name=name, options=dict(options or {}), **config), case)


class _Failure(Exception):
    """A failed case, carried out of hypothesis (after shrinking) with its case."""

    def __init__(self, case: FuzzCase, message: str) -> None:
        super().__init__(message)
        self.case, self.message = case, message


def check_fuzz(cfg: ConformanceConfig) -> str:
    """Random shapes, dtypes, padding, masks and options: a clear refusal or the reference (see the module)."""
    c = Ctx("fuzz", cfg)
    try:
        from hypothesis import HealthCheck, given, settings
    except ImportError:
        c.skip("hypothesis is not installed (pip install 'attnkit[testing]')")
    budget = examples_budget()
    counts = {"refused": 0, "matched": 0}

    @settings(max_examples=budget, deadline=None, database=None, derandomize=True, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_cases(cfg))
    def prop(case: FuzzCase) -> None:
        try:
            counts[run_case(cfg, case)] += 1
        except CheckFailed as exc:
            raise _Failure(case, str(exc)) from None

    try:
        prop()
    except _Failure as exc:
        msg = re.sub(r"^\[fuzz\] '[^']*': the drawn case: ", "", exc.message)
        opts = f", options={dict(cfg.options)!r}" if cfg.options else ""
        raise CheckFailed(f"[fuzz] {cfg.spec.name!r}: {msg}\n  reproduce (shrunk by hypothesis): "
                          f"attnkit.testing.fuzz.replay({cfg.name!r}, attnkit.testing.fuzz.{exc.case!r}{opts})"
                          ) from None
    if counts["matched"] == 0:
        c.skip(f"all {budget} draws were refused with attnkit errors (nothing was compared with the reference); "
               f"raise ATTNKIT_FUZZ_EXAMPLES or check the spec's declared capabilities and limits")
    dts = ", ".join(sorted({DTYPE_NAMES[DTYPES[d]] for d in cfg.caps.dtypes}))
    return (f"{budget} examples (ATTNKIT_FUZZ_EXAMPLES): {counts['matched']} matched the reference, "
            f"{counts['refused']} refused clearly (dtypes {dts})")
