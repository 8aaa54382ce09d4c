"""Capabilities that make the kit skip a check with their reason, and only when declared.

``queries_interact``: queries mix (landmarks, clusters, a top-u choice), so a NaN query may spread:
``nan_queries`` is skipped. ``selection_sees_future``: a causal selection reads the whole sequence (LSH
chunks, balanced clusters), so ``causality`` is skipped (the plugin tests that no attended pair is in the
future). Without the declaration, the broken implementation each check targets still fails it.
"""

from __future__ import annotations

import pytest
from broken_impls import LeakyFutureAttention, QueryMixingAttention

import attnkit
from attnkit.testing import run_conformance

#: (capability, check it skips, an implementation that fails that check, text of its failure or None)
CASES = [
    ("queries_interact", "nan_queries", QueryMixingAttention, None),
    ("selection_sees_future", "causality", LeakyFutureAttention, "leaks the future"),
]


@pytest.mark.parametrize("capability, check, cls, failure", CASES, ids=[c[0] for c in CASES])
def test_default_is_false(capability, check, cls, failure):
    assert getattr(attnkit.Capabilities(), capability) is False
    assert getattr(attnkit.get_spec("softmax").capabilities, capability) is False


@pytest.mark.parametrize("capability, check, cls, failure", CASES, ids=[c[0] for c in CASES])
def test_declared_capability_skips_the_check_with_the_reason(capability, check, cls, failure):
    caps = attnkit.Capabilities(**{capability: True})
    name = f"kit-{capability.replace('_', '-')}-declared"
    with attnkit.registered(cls, name=name, capabilities=caps):
        result = run_conformance(name, checks=[check])[check]
    assert result.status == "skipped" and f"declares {capability}" in result.message


@pytest.mark.parametrize("capability, check, cls, failure", CASES, ids=[c[0] for c in CASES])
def test_undeclared_the_check_still_fails(capability, check, cls, failure):
    name = f"kit-{capability.replace('_', '-')}-undeclared"
    with attnkit.registered(cls, name=name):
        result = run_conformance(name, checks=[check])[check]
    assert result.status == "failed"
    if failure is not None:
        assert failure in result.message
