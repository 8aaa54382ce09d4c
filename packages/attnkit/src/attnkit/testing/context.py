"""What every check shares: inputs, building, calling, comparing and failing with context.

:class:`Ctx` is created by each check (``c = Ctx("causality", cfg)``); its
methods build the implementation under a fixed seed in eval mode, call it
(turning any exception into a failure that names the case), compare tensors
element-wise against a tolerance (reporting the worst element) and fail or
skip with the check's name and the implementation's name in the message.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..backends import why_unavailable
from .cases import FAMILIES, Case, generate
from .config import DTYPE_NAMES, DTYPES, CheckFailed, CheckSkipped, ConformanceConfig

__all__ = ["Ctx", "isolated", "make_inputs", "noise_like", "perturb", "after", "grads", "fmt_shape", "seeded"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the global CPU RNG seeded to ``seed``; the caller's RNG state is restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# ---------------------------------------------------------------- inputs
def make_inputs(B: int, H: int, L: int, S: int, D: int, E: int, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", seed: int = 0, std: float = 1.0,
                requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` i.i.d. N(0, std²).

    Drawn in float64 from ``torch.Generator().manual_seed(seed)`` (q, then k,
    then v) and cast to ``dtype``, so every dtype sees the same numbers.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((B, H, L, D), (B, H, S, D), (B, H, S, E)):
        t = (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(device=device, dtype=dtype)
        out.append(t.requires_grad_(requires_grad))
    return out[0], out[1], out[2]


def noise_like(x: Tensor, seed: int, scale: float = 3.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(x.shape, generator=g, dtype=torch.float64) * scale).to(device=x.device, dtype=x.dtype)


def perturb(x: Tensor, where: Tensor, seed: int) -> Tensor:
    """``x`` plus large noise where the bool ``where`` (broadcastable to ``x``) is True."""
    return torch.where(where, x + noise_like(x, seed), x)


def after(n: int, start: int, device: torch.device) -> Tensor:
    """Bool ``(1, 1, n, 1)``: True at positions >= start (along dim 2)."""
    return (torch.arange(n, device=device) >= start)[None, None, :, None]


def shape_hints(spec: Any, H: int, D: int, E: int) -> dict[str, int]:
    """``num_heads``/``head_dim`` hints, plus ``value_dim = E`` where the factory names a ``value_dim`` option.

    ``value_dim`` is added only when the spec's options can be read and include it
    (``build_with_hints`` sends every hint to a factory whose options cannot be read).
    """
    hints = {"num_heads": H, "head_dim": D}
    try:
        if any(o.name == "value_dim" for o in spec.resolved_options()):
            hints["value_dim"] = E      # e.g. a learned value convolution built for E
    except Exception:  # noqa: BLE001 - unreadable options: the build reports why
        pass
    return hints


def meta_initialised(build: Callable[[], Any], device: torch.device, seed: int,
                     fail: Callable[[str], None]) -> Any:
    """The meta-device recipe: ``build()`` under ``torch.device("meta")``, ``to_empty(device)``, then
    ``reset_parameters()`` under ``torch.manual_seed(seed)`` (the global RNG restored after). ``fail`` reports
    what went wrong (a build that reads tensor values, no ``reset_parameters``, an exception in either)."""
    try:
        with torch.device("meta"):
            module = build()
    except Exception as exc:  # noqa: BLE001 - reported as a failure with context
        fail(f"building under torch.device('meta') raised {type(exc).__name__}: {exc} (a build must not read "
             "tensor values: no .item(), .tolist() or NumPy on a tensor it creates)")
    if not hasattr(module, "reset_parameters"):
        fail("the module has no reset_parameters() (attnkit.Attention and attnkit.Block provide one)")
    try:
        module = module.to_empty(device=device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module.reset_parameters()
    except Exception as exc:  # noqa: BLE001
        fail(f"to_empty(device={device.type!r}) then reset_parameters() raised {type(exc).__name__}: {exc}")
    return module


def fmt_shape(t: Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def describe_kwargs(kw: Mapping[str, Any]) -> str:
    parts = []
    for k, v in kw.items():
        if isinstance(v, Tensor):
            parts.append(f"{k}=<{DTYPE_NAMES.get(v.dtype, str(v.dtype))} {fmt_shape(v)}>")
        else:
            parts.append(f"{k}={v!r}")
    return ", ".join(parts)


def grads(attn: Any, out: Tensor, inputs: Sequence[Tensor], seed: int) -> list[Tensor | None]:
    """Gradients of ``<out, noise>`` w.r.t. ``inputs`` and then every trainable parameter of ``attn``."""
    params = [p for p in attn.parameters() if p.requires_grad]
    g = noise_like(out, seed, scale=1.0)
    return list(torch.autograd.grad(out, list(inputs) + params, g, allow_unused=True))


def grad_names(attn: Any, inputs: str = "qkv") -> list[str]:
    return list(inputs) + [f"parameter {n}" for n, p in attn.named_parameters() if p.requires_grad]


def isolated(fn: Callable[[ConformanceConfig], Any]) -> Callable[[ConformanceConfig], Any]:
    """Run a check inside :func:`torch.random.fork_rng` (the caller's RNG state is left alone) and
    with one intra-op CPU thread (restored after).

    The kit's tensors are tiny: intra-op threads buy nothing there, and on a
    busy machine oversubscribed threads made the checks 20-30x slower.
    """

    @functools.wraps(fn)
    def wrapper(cfg: ConformanceConfig) -> Any:
        __tracebackhide__ = True  # pytest: start tracebacks at the check
        device = torch.device(cfg.device)
        devices = [device] if device.type == "cuda" else []
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            with torch.random.fork_rng(devices=devices):
                return fn(cfg)
        finally:
            torch.set_num_threads(threads)

    return wrapper


# ------------------------------------------------------------- the context
class Ctx:
    """Helpers shared by the checks: building, calling, comparing, failing."""

    def __init__(self, check: str, cfg: ConformanceConfig) -> None:
        self.check = check
        self.cfg = cfg
        self.spec = cfg.spec
        self.caps = cfg.caps
        self.device = cfg.device
        B, H, L, S, D, E = cfg.shapes
        self.B, self.H, self.L, self.S, self.D, self.E = B, H, L, S, D, E
        try:
            self.takes = {o.name for o in self.spec.resolved_options()}
        except Exception:  # noqa: BLE001 - build reports import problems with their reason
            self.takes = {"num_heads", "head_dim"}

    # -- outcomes
    def fail(self, msg: str) -> None:
        __tracebackhide__ = True
        raise CheckFailed(f"[{self.check}] {self.spec.name!r}: {msg}")

    def skip(self, reason: str) -> None:
        raise CheckSkipped(reason)

    # -- dtypes, modes, backends
    def dtypes(self) -> list[torch.dtype]:
        return [DTYPES[n] for n in self.cfg.tested_dtypes()]

    def precise(self) -> torch.dtype:
        """float64 where declared (tight tolerances for invariance checks), else float32, else the first."""
        for name in ("float64", "float32"):
            if name in self.caps.dtypes:
                return DTYPES[name]
        return DTYPES[self.caps.dtypes[0]]

    def float_dtypes(self) -> list[torch.dtype]:
        """float32 / float64 among the tested dtypes (for gradients); at least the precise one."""
        out = [d for d in self.dtypes() if d in (torch.float32, torch.float64)]
        return out or [self.precise()]

    def causal_modes(self) -> list[bool]:
        return [c for c, ok in ((False, self.caps.noncausal), (True, self.caps.causal)) if ok]

    def tol(self, dtype: torch.dtype, factor: float = 1.0) -> tuple[float, float]:
        atol, rtol = self.cfg.tol(dtype)
        return atol * factor, rtol * factor

    def backends(self) -> tuple[list[str | None], list[str]]:
        """Backends to force one at a time that can run here, and why the others cannot.

        ``[None]`` (build without ``backend=``) when the factory takes no
        ``backend`` option. Availability: :func:`attnkit.backends.why_unavailable`
        with ``forced=True`` (triton on CPU only under ``TRITON_INTERPRET=1``).
        """
        if "backend" not in self.takes:
            return [None], []
        ok: list[str | None] = []
        why: list[str] = []
        for b in self.caps.backends:
            reason = why_unavailable(b, self.device, forced=True)
            if reason is None:
                ok.append(b)
            else:
                why.append(f"{b}: {reason}")
        return ok, why

    def trains(self, backend: str | None) -> bool:
        """Whether ``backend`` has a backward (not a forward-only backend)."""
        return backend is None or backend not in self.caps.forward_only_backends

    # -- building and calling
    def build(self, *, dtype: torch.dtype | None = None, heads: int | None = None, head_dim: int | None = None,
              seed: int | None = None, backend: str | None = None, **extra: Any) -> Any:
        """Build the implementation under ``torch.manual_seed(seed)`` (RNG forked), eval mode.

        ``backend=None`` leaves the option out (the spec's default).
        """
        hints = shape_hints(self.spec, self.H if heads is None else heads,
                            self.D if head_dim is None else head_dim, self.E)
        if backend is not None:
            extra["backend"] = backend
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed if seed is None else seed)
            attn = self.cfg.registry.build_with_hints(self.cfg.name, hints, **{**self.cfg.options, **extra})
        attn = attn.to(device=self.device)
        if dtype is not None:
            attn = attn.to(dtype=dtype)
        return attn.eval()

    def cases(self, attn: Any, families: Iterable[str] = FAMILIES, *, L: int | None = None,
              S: int | None = None, B: int | None = None, causal_modes: Iterable[bool] | None = None) -> list[Case]:
        """The case generator for this spec (:func:`attnkit.testing.cases.generate`), within ``attn.limits``."""
        return generate(self.caps, B=self.B if B is None else B, H=self.H, L=self.L if L is None else L,
                        S=self.S if S is None else S, device=self.device, families=families,
                        limits=getattr(attn, "limits", None), long_length=self.cfg.long_length,
                        causal_modes=causal_modes)

    def inputs(self, L: int, S: int, dtype: torch.dtype, *, seed_offset: int = 0, B: int | None = None,
               requires_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        return make_inputs(self.B if B is None else B, self.H, L, S, self.D, self.E, dtype=dtype,
                           device=self.device, seed=self.cfg.seed * 1000 + 17 + seed_offset,
                           requires_grad=requires_grad)

    def call(self, attn: Any, case: str, q: Tensor, k: Tensor, v: Tensor, *, grad: bool = False,
             **kw: Any) -> Tensor:
        """``attn(q, k, v, **kw)``; any exception or a malformed result is a failure naming the case."""
        __tracebackhide__ = True
        try:
            with torch.set_grad_enabled(grad):
                out = attn(q, k, v, **kw)
        except Exception as exc:  # noqa: BLE001 - reported as a failure with context
            self.fail(
                f"{case}: forward(q {fmt_shape(q)}, k {fmt_shape(k)}, v {fmt_shape(v)}"
                f"{', ' if kw else ''}{describe_kwargs(kw)}) raised {type(exc).__name__}: {exc}"
            )
        expected = (*q.shape[:3], v.shape[-1])
        if not isinstance(out, Tensor):
            self.fail(f"{case}: forward returned {type(out).__name__}, expected a Tensor {expected}")
        if tuple(out.shape) != expected:
            self.fail(f"{case}: output shape {tuple(out.shape)}, expected (B, H, L, E) = {expected}")
        return out

    def expect_error(self, label: str, error: type[Exception], why: str, fn: Callable[[], Any]) -> None:
        """``fn()`` must raise ``error`` (``why`` says what the contract demands)."""
        __tracebackhide__ = True
        try:
            with torch.no_grad():
                fn()
        except error:
            return
        except Exception as exc:  # noqa: BLE001
            self.fail(f"{label}: {why}; the call raised {type(exc).__name__}: {exc}; it must raise "
                      f"attnkit.errors.{error.__name__}")
        self.fail(f"{label}: {why}; yet the call was accepted silently; it must raise "
                  f"attnkit.errors.{error.__name__} (nothing is ever silently ignored or cast)")

    # -- comparing
    def close(self, actual: Tensor, expected: Tensor, case: str, *, dtype: torch.dtype,
              what: str = "output", atol: float | None = None, rtol: float | None = None,
              against: str = "expected", slack: Tensor | None = None, slack_why: str = "") -> None:
        """Fail unless ``|actual - expected| <= atol + rtol·|expected| (+ slack)`` everywhere (and finite).

        ``slack``: an elementwise allowance added to the tolerance (shaped like ``expected``), with
        ``slack_why`` saying where it comes from in the failure message.
        """
        __tracebackhide__ = True
        d_atol, d_rtol = self.tol(dtype)
        atol = d_atol if atol is None else atol
        rtol = d_rtol if rtol is None else rtol
        a = actual.detach().to(torch.float64)
        e = expected.detach().to(torch.float64)
        if a.shape != e.shape:
            self.fail(f"{case}: {what} has shape {tuple(a.shape)}, {against} {tuple(e.shape)}")
        for t, label, other in ((a, what, e), (e, against, a)):
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                idx = tuple(int(i) for i in bad.nonzero()[0])
                self.fail(f"{case}: {label} has {int(bad.sum())} non-finite value(s), e.g. {t[idx].item()} "
                          f"at index {idx} (the other side: {other[idx].item():.6g})")
        diff = (a - e).abs().nan_to_num(nan=math.inf)
        allowed = atol + rtol * e.abs()
        if slack is not None:
            allowed = allowed + slack.detach().to(torch.float64).nan_to_num(nan=0.0)
        excess = diff - allowed
        if bool((excess > 0).any()):
            flat = int(excess.flatten().argmax())
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
            self.fail(
                f"{case}: {what} vs {against}: max |diff| = {diff.max().item():.3g}; worst at "
                f"index {idx}: got {a[idx].item():.6g}, {against} {e[idx].item():.6g}; tolerance "
                f"atol={atol:.3g} + rtol={rtol:.3g}·|{against}|"
                + (f" + {slack_why} ({float(slack[idx]):.3g} there)" if slack is not None else "")
                + f" ({DTYPE_NAMES.get(dtype, dtype)}, {int((excess > 0).sum())} of {excess.numel()} elements outside)"
            )

    def exact(self) -> dict[str, float]:
        """Tolerances demanding bitwise equality on CPU (default tolerances elsewhere)."""
        return {"atol": 0.0, "rtol": 0.0} if self.device.type == "cpu" else {}

    def finite(self, t: Tensor | None, case: str, what: str) -> None:
        __tracebackhide__ = True
        if t is None:
            return
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            self.fail(f"{case}: {what} has {int(bad.sum())} non-finite value(s) (NaN/inf), e.g. "
                      f"{t.detach()[idx].item()} at index {idx}")

    def grads(self, attn: Any, out: Tensor, inputs: Sequence[Tensor], case: str, seed: int) -> list[Tensor | None]:
        """:func:`grads`, a failure naming the case when backward raises."""
        __tracebackhide__ = True
        try:
            return grads(attn, out, inputs, seed)
        except Exception as exc:  # noqa: BLE001
            self.fail(f"{case}: backward raised {type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")
