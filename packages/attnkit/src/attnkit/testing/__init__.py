"""The conformance kit: a reusable suite any plugin runs against its registered names.

Two faces, one implementation (:mod:`attnkit.testing.checks`):

* :class:`AttentionConformance` (pytest): subclass it in your test suite and
  set ``name`` (and ``options``); pytest collects one test per check.
* :func:`run_conformance` (no pytest needed): runs the same checks and returns
  a :class:`ConformanceReport`; ``attnkit check NAME...`` calls it.

pytest is imported only by :mod:`attnkit.testing.suite`, and only when
``AttentionConformance`` is first accessed, so ``run_conformance`` and
:mod:`attnkit.testing.checks` work without pytest installed. See
``docs/conformance.md``.
"""

from __future__ import annotations

from typing import Any

from .checks import (
    CHECKS,
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    DEFAULT_SHAPES,
    CheckFailed,
    CheckResult,
    CheckSkipped,
    ConformanceConfig,
    ConformanceConfigError,
    ConformanceReport,
    ErrorDistribution,
    make_inputs,
    run_check,
    run_conformance,
)

__all__ = [
    "AttentionConformance", "CHECKS", "DEFAULT_ATOL", "DEFAULT_RTOL", "DEFAULT_SHAPES", "CheckFailed",
    "CheckResult", "CheckSkipped", "ConformanceConfig", "ConformanceConfigError", "ConformanceReport",
    "ErrorDistribution", "make_inputs", "run_check", "run_conformance",
]


def __getattr__(name: str) -> Any:
    if name == "AttentionConformance":  # imports pytest; only on demand
        from .suite import AttentionConformance

        return AttentionConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
