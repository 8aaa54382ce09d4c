"""The block suite: conformance checks for block-level mechanisms (``(B, L, dim) -> (B, L, dim)``).

Blocks are built by name with :func:`attnkit.build_block` (``name``,
``dim=``, ``num_heads=``, ``attention=`` plus options); the standard pre-norm
block is registered as ``"pre-norm"``. Two faces, as for attentions:
:func:`run_block_conformance` (no pytest) and
:class:`attnkit.testing.BlockConformance` (pytest). A check skips, with the
reason.
"""

from __future__ import annotations

import copy
import io
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import UnsupportedFeatureError
from .checks import CheckResult, ConformanceReport
from .config import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    DTYPES,
    CheckFailed,
    CheckSkipped,
    ConformanceConfigError,
    dtype_name,
)
from .context import isolated, meta_initialised, noise_like, perturb

__all__ = ["BLOCK_CHECKS", "BlockConformanceConfig", "run_block_check", "run_block_conformance"]


@dataclass
class BlockConformanceConfig:
    """What the block suite checks and how.

    Attributes:
        name: the registered block name (e.g. ``"pre-norm"``).
        options: extra options for :func:`attnkit.build_block`.
        attention: the attention the block is built with (a registered name).
        dim, num_heads: model width and heads (``dim % num_heads == 0``).
        batch, length: B and L of the inputs ``(B, L, dim)``; L >= 4.
        dtype: the dtype of the module and inputs (float64: exact comparisons).
        atol, rtol: per-dtype overrides of the default tolerances.
        skip: ``{check_name: reason}``.
        device, seed: where, and the seed of construction and inputs.
        registry: a registry with ``build_block`` (None: :func:`attnkit.build_block`).
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    attention: str = "softmax"
    dim: int = 8
    num_heads: int = 2
    batch: int = 2
    length: int = 9
    dtype: str | torch.dtype = "float64"
    atol: Mapping[str | torch.dtype, float] = field(default_factory=dict)
    rtol: Mapping[str | torch.dtype, float] = field(default_factory=dict)
    skip: Mapping[str, str] = field(default_factory=dict)
    device: str | torch.device = "cpu"
    seed: int = 0
    registry: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConformanceConfigError(f"name: expected a registered block name, got {self.name!r}")
        self.options = dict(self.options or {})
        for what in ("dim", "num_heads", "batch", "length"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConformanceConfigError(f"{what}: expected a positive int, got {v!r}")
        if self.dim % self.num_heads or self.length < 4:
            raise ConformanceConfigError(
                f"need dim % num_heads == 0 and length >= 4, got dim={self.dim}, num_heads={self.num_heads}, "
                f"length={self.length}")
        unknown = set(self.skip) - set(BLOCK_CHECKS)
        if unknown:
            raise ConformanceConfigError(f"skip: unknown block check(s) {sorted(unknown)}; the checks are "
                                         f"{list(BLOCK_CHECKS)}")
        self.dtype = dtype_name(self.dtype)
        self.atol = {**DEFAULT_ATOL, **{dtype_name(k): float(v) for k, v in self.atol.items()}}
        self.rtol = {**DEFAULT_RTOL, **{dtype_name(k): float(v) for k, v in self.rtol.items()}}
        self.device = torch.device(self.device)


class _BlockCtx:
    """Building, calling and comparing for one block check."""

    def __init__(self, check: str, cfg: BlockConformanceConfig) -> None:
        self.check, self.cfg = check, cfg
        self.dt = DTYPES[cfg.dtype]
        self.atol, self.rtol = cfg.atol[cfg.dtype], cfg.rtol[cfg.dtype]

    def fail(self, msg: str) -> None:
        __tracebackhide__ = True
        raise CheckFailed(f"[{self.check}] block {self.cfg.name!r} (attention {self.cfg.attention!r}): {msg}")

    def raw_build(self) -> Any:
        """``build_block(name, dim=, num_heads=, attention=, **options)`` of the configured registry (default
        :func:`attnkit.build_block`), as it comes: no seed, device, dtype or mode set."""
        cfg = self.cfg
        builder: Callable[..., Any] | None = getattr(cfg.registry, "build_block", None)
        if builder is None:
            import attnkit

            builder = attnkit.build_block
        return builder(cfg.name, dim=cfg.dim, num_heads=cfg.num_heads, attention=cfg.attention, **cfg.options)

    def build(self, seed: int | None = None) -> Any:
        cfg = self.cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed if seed is None else seed)
            try:
                block = self.raw_build()
            except Exception as exc:  # noqa: BLE001
                self.fail(f"build_block raised {type(exc).__name__}: {exc}")
        return block.to(device=cfg.device, dtype=self.dt).eval()

    def x(self, seed: int = 0, requires_grad: bool = False) -> Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1000 + 31 + seed)
        t = torch.randn(self.cfg.batch, self.cfg.length, self.cfg.dim, generator=g, dtype=torch.float64)
        return t.to(device=self.cfg.device, dtype=self.dt).requires_grad_(requires_grad)

    def call(self, block: Any, x: Tensor, label: str, grad: bool = False, **kw: Any) -> Tensor:
        __tracebackhide__ = True
        try:
            with torch.set_grad_enabled(grad):
                out = block(x, **kw)
        except UnsupportedFeatureError as exc:
            raise CheckSkipped(f"{label}: the block refuses it: {exc}") from exc
        except Exception as exc:  # noqa: BLE001
            self.fail(f"{label}: forward raised {type(exc).__name__}: {exc}")
        if not isinstance(out, Tensor) or tuple(out.shape) != tuple(x.shape):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            self.fail(f"{label}: output {got}, expected (B, L, dim) = {tuple(x.shape)}")
        return out

    def close(self, got: Tensor, want: Tensor, label: str, exact: bool = False) -> None:
        __tracebackhide__ = True
        atol, rtol = (0.0, 0.0) if exact and self.cfg.device.type == "cpu" else (self.atol, self.rtol)
        a, e = got.detach().double(), want.detach().double()
        diff = (a - e).abs().nan_to_num(nan=float("inf"))
        if bool((diff > atol + rtol * e.abs()).any()) or not bool(torch.isfinite(a).all()):
            idx = tuple(int(i) for i in torch.unravel_index(diff.flatten().argmax(), a.shape))
            self.fail(f"{label}: max |diff| = {diff.max().item():.3g} at index {idx} (got {a[idx].item():.6g}, "
                      f"expected {e[idx].item():.6g}; atol={atol:.3g}, rtol={rtol:.3g}, {self.cfg.dtype})")


def check_block_shapes(cfg: BlockConformanceConfig) -> None:
    """``(B, L, dim)`` in, ``(B, L, dim)`` out, the input's dtype, finite, input untouched; causal and not."""
    c = _BlockCtx("block_shapes", cfg)
    block = c.build()
    x = c.x()
    before = x.clone()
    for causal in (False, True):
        label = f"causal={causal}, (B, L, dim) = {tuple(x.shape)}, {cfg.dtype}"
        try:
            out = c.call(block, x, label, causal=causal)
        except CheckSkipped:
            continue
        if out.dtype != c.dt or not bool(torch.isfinite(out).all()):
            c.fail(f"{label}: output dtype {out.dtype} (expected {c.dt}), finite: {bool(torch.isfinite(out).all())}")
    if not torch.equal(x, before):
        c.fail("forward modified its input x in place")


def check_block_causality(cfg: BlockConformanceConfig) -> None:
    """With ``causal=True``, perturbing x at positions >= t changes no output at positions < t (several t)."""
    c = _BlockCtx("block_causality", cfg)
    block = c.build()
    x = c.x()
    L = cfg.length
    label = f"causal=True, L={L}, {cfg.dtype}"
    base = c.call(block, x, label, causal=True)
    for t in sorted({1, L // 2, L - 1}):
        where = (torch.arange(L, device=cfg.device) >= t)[None, :, None]
        out = c.call(block, perturb(x, where, seed=50 + t), label, causal=True)
        c.close(out[:, :t], base[:, :t], f"{label}: perturbing x at positions >= {t} changed outputs at positions "
                f"< {t}, so the block leaks the future")


def check_block_gradients(cfg: BlockConformanceConfig) -> None:
    """Gradients of x and of every parameter are finite (causal and not)."""
    c = _BlockCtx("block_gradients", cfg)
    block = c.build()
    for causal in (False, True):
        x = c.x(requires_grad=True)
        label = f"causal={causal}, {cfg.dtype}"
        try:
            out = c.call(block, x, label, grad=True, causal=causal)
        except CheckSkipped:
            continue
        named = [("x", x)] + [(f"parameter {n}", p) for n, p in block.named_parameters() if p.requires_grad]
        try:
            grads = torch.autograd.grad(out, [t for _, t in named], noise_like(out, 7, 1.0), allow_unused=True)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"{label}: backward raised {type(exc).__name__}: {exc}")
        if grads[0] is None:
            c.fail(f"{label}: the output has no gradient with respect to x")
        for (name, _), g in zip(named, grads):
            if g is not None and not bool(torch.isfinite(g).all()):
                c.fail(f"{label}: the gradient of {name} is not finite")


def check_block_state_dict(cfg: BlockConformanceConfig) -> None:
    """The ``state_dict`` (``torch.save``/``torch.load(weights_only=True)``) loaded into a block built under
    another seed gives the same outputs (exactly, on CPU)."""
    c = _BlockCtx("block_state_dict", cfg)
    a, b = c.build(cfg.seed), c.build(cfg.seed + 1)
    buf = io.BytesIO()
    try:
        torch.save(a.state_dict(), buf)
        buf.seek(0)
        b.load_state_dict(torch.load(buf, weights_only=True))
    except Exception as exc:  # noqa: BLE001
        c.fail(f"saving and loading the state_dict raised {type(exc).__name__}: {exc}")
    x = c.x()
    c.close(c.call(b, x, "loaded"), c.call(a, x, "original"), "a block loaded from the state_dict disagrees with "
            "the original (is some state not a parameter or buffer?)", exact=True)


def check_block_deepcopy(cfg: BlockConformanceConfig) -> None:
    """``copy.deepcopy`` of the block gives the same outputs (exactly, on CPU)."""
    c = _BlockCtx("block_deepcopy", cfg)
    block = c.build()
    try:
        other = copy.deepcopy(block)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"copy.deepcopy raised {type(exc).__name__}: {exc}")
    x = c.x()
    c.close(c.call(other, x, "deepcopy"), c.call(block, x, "original"), "the deep copy disagrees with the original",
            exact=True)


def check_block_checkpointing(cfg: BlockConformanceConfig) -> None:
    """In training mode, a step under ``torch.utils.checkpoint(use_reentrant=False)`` equals the plain step: the
    output, the auxiliary losses, the gradients of x and of every parameter, the buffers (causal and not; the same
    seed on both sides)."""
    from torch.utils.checkpoint import checkpoint

    from ..aux import aux_losses

    c = _BlockCtx("block_checkpointing", cfg)
    base = c.build().train()
    for causal in (False, True):
        label = f"causal={causal}, {cfg.dtype}, training mode"
        runs = []
        for checkpointed in (False, True):
            block = copy.deepcopy(base)
            x = c.x(requires_grad=True)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed + 11)
                if checkpointed:
                    try:
                        out = checkpoint(lambda t, b=block, cz=causal: b(t, causal=cz), x, use_reentrant=False)
                    except UnsupportedFeatureError as exc:
                        raise CheckSkipped(f"{label}: the block refuses it: {exc}") from exc
                    except Exception as exc:  # noqa: BLE001
                        c.fail(f"{label}, under torch.utils.checkpoint: forward raised {type(exc).__name__}: {exc}")
                else:
                    try:
                        out = c.call(block, x, label, grad=True, causal=causal)
                    except CheckSkipped:
                        break
                aux = aux_losses(block, weighted=False)
                loss = (out * noise_like(out, 9, 1.0)).sum() + sum(aux.values())
                params = [p for p in block.parameters() if p.requires_grad]
                try:
                    g = torch.autograd.grad(loss, [x, *params], allow_unused=True)
                except Exception as exc:  # noqa: BLE001
                    c.fail(f"{label}{', under torch.utils.checkpoint' if checkpointed else ''}: backward raised "
                           f"{type(exc).__name__}: {exc}")
            runs.append((out.detach(), {n: a.detach() for n, a in aux.items()}, g,
                         {n: b.detach().clone() for n, b in block.named_buffers() if b is not None}))
        if len(runs) < 2:
            continue
        (o0, a0, g0, b0), (o1, a1, g1, b1) = runs
        what = f"{label}, under torch.utils.checkpoint(use_reentrant=False)"
        c.close(o1, o0, f"{what}: output vs the plain step's")
        if sorted(a1) != sorted(a0):
            c.fail(f"{what}: recorded the auxiliary losses {sorted(a1)}, the plain step {sorted(a0)}")
        for n in a0:
            c.close(a1[n], a0[n], f"{what}: auxiliary loss {n!r} vs the plain step's")
        for i, (u, w) in enumerate(zip(g1, g0)):
            if (u is None) != (w is None):
                c.fail(f"{what}: gradient {i} (x, then parameters) is {'missing' if u is None else 'present'} here, "
                       "not in the plain step")
            if u is not None and w is not None:
                c.close(u, w, f"{what}: gradient {i} (x, then parameters) vs the plain step's")
        for n, buf in b0.items():
            if n in b1 and b1[n].shape == buf.shape:
                c.close(b1[n], buf, f"{what}: buffer {n!r} after the step vs the plain step's")


def check_block_meta_init(cfg: BlockConformanceConfig) -> None:
    """Built under ``torch.device("meta")``, moved with ``to_empty`` and initialised with ``reset_parameters()``
    under a seed, the block's ``state_dict`` and output equal a build under that seed (exactly, on CPU)."""
    c = _BlockCtx("block_meta_init", cfg)
    want = c.build(cfg.seed + 3)
    meta = meta_initialised(c.raw_build, cfg.device, cfg.seed + 3, c.fail).to(dtype=c.dt).eval()
    mine = meta.state_dict()
    for name, t in want.state_dict().items():
        if name not in mine:
            c.fail(f"after to_empty + reset_parameters() the state_dict lacks {name!r}")
        c.close(mine[name], t, f"state_dict entry {name!r} after to_empty + reset_parameters() vs a seeded build's",
                exact=True)
    x = c.x()
    for causal in (False, True):
        try:
            got = c.call(meta, x, f"meta-initialised, causal={causal}", causal=causal)
        except CheckSkipped:
            continue
        c.close(got, c.call(want, x, f"built, causal={causal}", causal=causal),
                f"built on the meta device, to_empty + reset_parameters(), causal={causal}: output vs a seeded "
                "build's", exact=True)


#: Every block check, in order; the pytest face has one ``test_<name>`` per key.
BLOCK_CHECKS: dict[str, Callable[[BlockConformanceConfig], None]] = {
    name: isolated(fn) for name, fn in (
        ("block_shapes", check_block_shapes),
        ("block_causality", check_block_causality),
        ("block_gradients", check_block_gradients),
        ("block_state_dict", check_block_state_dict),
        ("block_deepcopy", check_block_deepcopy),
        ("block_checkpointing", check_block_checkpointing),
        ("block_meta_init", check_block_meta_init),
    )
}


def run_block_check(check: str, cfg: BlockConformanceConfig) -> CheckResult:
    """Run one block check; the block's faults become a failed result, never an exception."""
    if check not in BLOCK_CHECKS:
        raise ConformanceConfigError(f"unknown block check {check!r}; the checks are {list(BLOCK_CHECKS)}")
    if check in cfg.skip:
        return CheckResult(check, "skipped", f"skipped by configuration: {cfg.skip[check]}")
    t0 = time.perf_counter()
    try:
        BLOCK_CHECKS[check](cfg)
    except CheckSkipped as exc:
        return CheckResult(check, "skipped", str(exc), time.perf_counter() - t0)
    except AssertionError as exc:
        return CheckResult(check, "failed", str(exc), time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001
        return CheckResult(check, "failed", f"raised {type(exc).__name__}: {exc}", time.perf_counter() - t0)
    return CheckResult(check, "passed", "", time.perf_counter() - t0)


def run_block_conformance(name: str, options: Mapping[str, Any] | None = None, *,
                          checks: Iterable[str] | None = None, **config: Any) -> ConformanceReport:
    """Run the block suite on the registered block ``name`` (without pytest).

    Keyword arguments are :class:`BlockConformanceConfig` fields
    (``attention=``, ``dim=``, ``num_heads=``, ``length=``, ``registry=``, ...).
    """
    cfg = BlockConformanceConfig(name=name, options=dict(options or {}), **config)
    selected = list(BLOCK_CHECKS) if checks is None else list(checks)
    unknown = [c for c in selected if c not in BLOCK_CHECKS]
    if unknown:
        raise ConformanceConfigError(f"checks: unknown block check(s) {unknown}; the checks are {list(BLOCK_CHECKS)}")
    return ConformanceReport(name, dict(cfg.options), [run_block_check(c, cfg) for c in selected])
