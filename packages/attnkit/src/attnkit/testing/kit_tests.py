"""The items ``pytest --attnkit-check NAME`` adds (see :mod:`attnkit_pytest`).

pytest collects this module only when the option is given; the plugin
parametrises :func:`test_attnkit_conformance` over every (NAME, check) pair.
"""

from __future__ import annotations

from typing import Any

import pytest

from attnkit.testing.checks import CHECKS, CheckSkipped, ConformanceConfig


@pytest.mark.attnkit_conformance
def test_attnkit_conformance(attnkit_case: tuple[str, dict[str, Any], str]) -> None:
    """One check of the conformance kit on one registered name (``docs/conformance.md`` says what each proves)."""
    __tracebackhide__ = True
    name, options, check = attnkit_case
    cfg = ConformanceConfig(name=name, options=dict(options))
    try:
        note = CHECKS[check](cfg)
    except CheckSkipped as exc:
        pytest.skip(f"{check}: {exc}")
    if isinstance(note, str) and note:
        print(f"{name} {check}: {note}")
