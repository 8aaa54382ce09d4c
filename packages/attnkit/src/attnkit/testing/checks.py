"""The table of conformance checks and the runner without pytest: one implementation of the kit.

Each check is a plain function of a :class:`ConformanceConfig` living in the
module of its concern (one screen each):

==========================  ===================================================
module                      checks
==========================  ===================================================
``shapes_dtypes``           shapes_dtypes, layouts, cross_attention, batch_independence, determinism
``bad_input``               refusals, empty_sequences, padded_values, nan_queries
``causality``               causality
``masks``                   key_padding, fully_masked_rows, attn_mask, mask_objects
``reference``               reference, error_bound
``scaled_inputs``           scaled_inputs (approximate specs: q, k scaled by 10, 30, 100)
``streaming``               streaming, state_validation
``backends``                backends
``gradients``               gradients, training_mode, gradcheck, double_backward
``grad_modes``              inference_mode, autocast, checkpointing, func_transforms
``aux_losses``              aux_losses (specs declaring auxiliary losses)
``serialisation``           state_dict, serialisation, meta_init
``exporting``               export (torch.export: the program against eager, mask inputs, refusals)
``fuzz``                    fuzz (hypothesis: random shapes, dtypes, padding, masks, options)
==========================  ===================================================

A check returns (it passed; a returned string is a note shown in the report,
e.g. a measured figure), raises :class:`CheckFailed` (an ``AssertionError``:
which check, which case, which argument, the measured difference against the
tolerance) or raises :class:`CheckSkipped` (the reason; never a vacuous pass).
Every case comes from one generator, :mod:`attnkit.testing.cases`.

:class:`attnkit.testing.AttentionConformance` (pytest) and
:func:`run_conformance` (no pytest; used by ``attnkit check``) both call
:data:`CHECKS`. This module must not import pytest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .aux_losses import check_aux_losses
from .backends import check_backends
from .bad_input import check_empty_sequences, check_nan_queries, check_padded_values, check_refusals
from .causality import check_causality
from .config import (
    DEFAULT_ATOL,
    DEFAULT_LONG_LENGTH,
    DEFAULT_RTOL,
    DEFAULT_SHAPES,
    DEFAULT_STREAMING_CHUNKS,
    DTYPES,
    CheckFailed,
    CheckSkipped,
    ConformanceConfig,
    ConformanceConfigError,
    ErrorDistribution,
)
from .context import isolated, make_inputs
from .exporting import check_export, check_export_dynamic
from .fuzz import check_fuzz
from .grad_modes import check_autocast, check_checkpointing, check_func_transforms, check_inference_mode
from .gradients import check_double_backward, check_gradcheck, check_gradients, check_training_mode
from .masks import check_attn_mask, check_fully_masked_rows, check_key_padding, check_mask_objects
from .reference import check_error_bound, check_reference
from .scaled_inputs import check_scaled_inputs
from .serialisation import check_meta_init, check_serialisation, check_state_dict
from .shapes_dtypes import (
    check_batch_independence,
    check_cross_attention,
    check_determinism,
    check_layouts,
    check_shapes_dtypes,
)
from .streaming import check_state_validation, check_streaming

__all__ = [
    "CHECKS", "DEFAULT_ATOL", "DEFAULT_LONG_LENGTH", "DEFAULT_RTOL", "DEFAULT_SHAPES", "DEFAULT_STREAMING_CHUNKS",
    "DTYPES", "CheckFailed", "CheckResult", "CheckSkipped", "ConformanceConfig", "ConformanceConfigError",
    "ConformanceReport", "ErrorDistribution", "make_inputs", "run_check", "run_conformance", "check_attn_mask",
    "check_autocast", "check_aux_losses", "check_backends", "check_batch_independence", "check_causality",
    "check_checkpointing", "check_cross_attention", "check_determinism", "check_double_backward",
    "check_empty_sequences", "check_error_bound", "check_export",
    "check_export_dynamic", "check_func_transforms", "check_fuzz",
    "check_fully_masked_rows", "check_gradcheck", "check_gradients", "check_inference_mode", "check_key_padding",
    "check_layouts",
    "check_mask_objects",
    "check_meta_init", "check_nan_queries", "check_padded_values", "check_reference", "check_refusals",
    "check_serialisation", "check_shapes_dtypes", "check_scaled_inputs", "check_state_dict",
    "check_state_validation", "check_streaming", "check_training_mode",
]

#: Every check, in the order they run; the keys are the names used by ``skip``
#: and reports, and the pytest suite has one ``test_<name>`` method per key.
CHECKS: dict[str, Callable[[ConformanceConfig], Any]] = {
    name: isolated(fn) for name, fn in (
        ("shapes_dtypes", check_shapes_dtypes),
        ("layouts", check_layouts),
        ("refusals", check_refusals),
        ("causality", check_causality),
        ("key_padding", check_key_padding),
        ("fully_masked_rows", check_fully_masked_rows),
        ("attn_mask", check_attn_mask),
        ("mask_objects", check_mask_objects),
        ("cross_attention", check_cross_attention),
        ("batch_independence", check_batch_independence),
        ("reference", check_reference),
        ("error_bound", check_error_bound),
        ("scaled_inputs", check_scaled_inputs),
        ("streaming", check_streaming),
        ("state_validation", check_state_validation),
        ("backends", check_backends),
        ("gradients", check_gradients),
        ("training_mode", check_training_mode),
        ("inference_mode", check_inference_mode),
        ("autocast", check_autocast),
        ("checkpointing", check_checkpointing),
        ("func_transforms", check_func_transforms),
        ("gradcheck", check_gradcheck),
        ("double_backward", check_double_backward),
        ("aux_losses", check_aux_losses),
        ("state_dict", check_state_dict),
        ("serialisation", check_serialisation),
        ("meta_init", check_meta_init),
        ("export", check_export),
        ("export_dynamic", check_export_dynamic),
        ("determinism", check_determinism),
        ("empty_sequences", check_empty_sequences),
        ("padded_values", check_padded_values),
        ("nan_queries", check_nan_queries),
        ("fuzz", check_fuzz),
    )
}


# ================================================================ running
@dataclass
class CheckResult:
    """One check's outcome: ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``.

    ``message`` is the failure, the skip reason, or a passed check's note
    (e.g. the measured error vs softmax).
    """

    check: str
    status: str
    message: str = ""
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ConformanceReport:
    """Per-check results of :func:`run_conformance` for one implementation."""

    name: str
    options: dict[str, Any]
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks do not count against it)."""
        return not self.failed

    @property
    def passed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "passed"]

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def skipped(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "skipped"]

    def __getitem__(self, check: str) -> CheckResult:
        for r in self.results:
            if r.check == check:
                return r
        raise KeyError(f"no result for check {check!r}; checks: {[r.check for r in self.results]}")

    def summary(self) -> str:
        secs = sum(r.seconds for r in self.results)
        opts = f" {self.options}" if self.options else ""
        return (f"{self.name}{opts}: {len(self.passed)} passed, {len(self.failed)} failed, "
                f"{len(self.skipped)} skipped ({secs:.1f}s)")

    def format(self) -> str:
        """A human-readable multi-line report."""
        lines = [self.summary()]
        tags = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}
        for r in self.results:
            line = f"  {tags.get(r.status, r.status.upper()):4}  {r.check}"
            if r.message:
                line += f": {r.message}"
            lines.append(line)
        return "\n".join(lines)

    __str__ = format

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "options": {k: (v if isinstance(v, (bool, int, float, str, type(None))) else repr(v))
                        for k, v in self.options.items()},
            "ok": self.ok,
            "passed": len(self.passed),
            "failed": len(self.failed),
            "skipped": len(self.skipped),
            "checks": [r.as_dict() for r in self.results],
        }


def run_check(check: str, cfg: ConformanceConfig) -> CheckResult:
    """Run one check; never raises for the implementation's faults (they become a failed result)."""
    if check not in CHECKS:
        raise ConformanceConfigError(f"unknown check {check!r}; the checks are {list(CHECKS)}")
    if check in cfg.skip:
        return CheckResult(check, "skipped", f"skipped by configuration: {cfg.skip[check]}")
    t0 = time.perf_counter()
    try:
        note = CHECKS[check](cfg)
    except CheckSkipped as exc:
        return CheckResult(check, "skipped", str(exc), time.perf_counter() - t0)
    except ConformanceConfigError:
        raise
    except AssertionError as exc:
        return CheckResult(check, "failed", str(exc), time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - an unexpected error is a failure of that check
        return CheckResult(check, "failed", f"raised {type(exc).__name__}: {exc}", time.perf_counter() - t0)
    return CheckResult(check, "passed", note if isinstance(note, str) else "", time.perf_counter() - t0)


def run_conformance(name: str, options: Mapping[str, Any] | None = None, *,
                    checks: Iterable[str] | None = None, registry: Any = None, **config: Any) -> ConformanceReport:
    """Run the conformance kit on the registered implementation ``name``, without pytest.

    Args:
        name: registered name (alias, ``family/name`` or ``distribution:name``).
        options: extra build options (as for :func:`attnkit.build`).
        checks: names of the checks to run (default: all of :data:`CHECKS`).
        registry: the :class:`attnkit.registry.Registry` holding ``name``
            (default: the process-wide registry).
        **config: further :class:`ConformanceConfig` fields (``dtypes``,
            ``atol``, ``rtol``, ``shapes``, ``skip``, ``error_distribution``,
            ``queries_interact``, ...).

    Returns:
        a :class:`ConformanceReport`; ``report.ok`` is False when a check failed.

    Raises:
        UnknownAttentionError, AmbiguousNameError: ``name`` does not resolve.
        ConformanceConfigError: an invalid configuration.
    """
    cfg = ConformanceConfig(name=name, options=dict(options or {}), registry=registry, **config)
    cfg.spec  # noqa: B018 - resolve the name before any work (clear error)
    selected = list(CHECKS) if checks is None else list(checks)
    unknown = [c for c in selected if c not in CHECKS]
    if unknown:
        raise ConformanceConfigError(f"checks: unknown check name(s) {unknown}; the checks are {list(CHECKS)}")
    try:  # a factory that cannot be imported fails once, as "import", not once per check
        cfg.spec.load_factory()
    except Exception as exc:  # noqa: BLE001 - the plugin's fault: a failed result, not a crash
        return ConformanceReport(name, dict(cfg.options), [CheckResult(
            "import", "failed",
            f"cannot import the factory {cfg.spec.factory_path} of {cfg.spec.name!r}: {type(exc).__name__}: {exc}; "
            f"the {len(selected)} check(s) were not run")])
    return ConformanceReport(name, dict(cfg.options), [run_check(c, cfg) for c in selected])
