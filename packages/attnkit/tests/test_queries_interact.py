"""``Capabilities.queries_interact``: the spec says queries mix, so the kit skips ``nan_queries`` with that reason."""

from __future__ import annotations

from broken_impls import QueryMixingAttention

import attnkit
from attnkit.testing import run_conformance


def test_default_is_false():
    assert attnkit.Capabilities().queries_interact is False
    assert attnkit.get_spec("softmax").capabilities.queries_interact is False


def test_declared_interaction_skips_nan_queries_with_the_reason():
    caps = attnkit.Capabilities(queries_interact=True)
    with attnkit.registered(QueryMixingAttention, name="kit-query-mixing-declared", capabilities=caps):
        check = run_conformance("kit-query-mixing-declared", checks=["nan_queries"])["nan_queries"]
    assert check.status == "skipped" and "declares queries_interact" in check.message


def test_undeclared_interaction_still_fails_nan_queries():
    with attnkit.registered(QueryMixingAttention, name="kit-query-mixing-undeclared"):
        check = run_conformance("kit-query-mixing-undeclared", checks=["nan_queries"])["nan_queries"]
    assert check.status == "failed"
