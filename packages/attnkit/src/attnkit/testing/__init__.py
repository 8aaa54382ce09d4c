"""The conformance kit: a reusable suite any plugin runs against its registered names.

Two faces, one implementation:

* :class:`AttentionConformance` (pytest): subclass it in your test suite and
  set ``name`` (and ``options``); pytest collects one test per check.
* :func:`run_conformance` (no pytest needed): runs the same checks and returns
  a :class:`ConformanceReport`; ``attnkit check NAME...`` calls it.

The same for block-level mechanisms: :class:`BlockConformance` and
:func:`run_block_conformance`.

Layout: :mod:`~attnkit.testing.cases` (the one case generator),
:mod:`~attnkit.testing.config` (configuration, tolerances, outcomes),
:mod:`~attnkit.testing.context` (building, calling, comparing), one module per
concern holding its checks (``shapes_dtypes``, ``bad_input``, ``causality``,
``masks``, ``reference``, ``streaming``, ``backends``, ``gradients``,
``serialisation``), :mod:`~attnkit.testing.checks` (the table :data:`CHECKS`
and the runner) and :mod:`~attnkit.testing.blocks` (the block suite).

pytest is imported only by :mod:`attnkit.testing.suite`, and only when
``AttentionConformance`` or ``BlockConformance`` is first accessed, so
``run_conformance`` and the check modules work without pytest installed. See
``docs/conformance.md``.
"""

from __future__ import annotations

from typing import Any

from .blocks import BLOCK_CHECKS, BlockConformanceConfig, run_block_check, run_block_conformance
from .cases import Case
from .cases import generate as generate_cases
from .checks import (
    CHECKS,
    DEFAULT_ATOL,
    DEFAULT_LONG_LENGTH,
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
    "AttentionConformance", "BLOCK_CHECKS", "BlockConformance", "BlockConformanceConfig", "CHECKS", "Case",
    "DEFAULT_ATOL", "DEFAULT_LONG_LENGTH", "DEFAULT_RTOL", "DEFAULT_SHAPES", "CheckFailed", "CheckResult",
    "CheckSkipped", "ConformanceConfig", "ConformanceConfigError", "ConformanceReport", "ErrorDistribution",
    "generate_cases", "make_inputs", "run_block_check", "run_block_conformance", "run_check", "run_conformance",
]


def __getattr__(name: str) -> Any:
    if name in ("AttentionConformance", "BlockConformance"):  # imports pytest; only on demand
        from . import suite

        return getattr(suite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
