"""``Capabilities.selection_sees_future``: the spec says its causal selection reads the whole sequence, so the kit
skips ``causality`` with that reason; without the declaration a leaking implementation still fails it."""

from __future__ import annotations

from broken_impls import LeakyFutureAttention

import attnkit
from attnkit.testing import run_conformance


def test_default_is_false():
    assert attnkit.Capabilities().selection_sees_future is False
    assert attnkit.get_spec("softmax").capabilities.selection_sees_future is False


def test_declared_selection_skips_causality_with_the_reason():
    caps = attnkit.Capabilities(selection_sees_future=True)
    with attnkit.registered(LeakyFutureAttention, name="kit-selection-declared", capabilities=caps):
        check = run_conformance("kit-selection-declared", checks=["causality"])["causality"]
    assert check.status == "skipped" and "declares selection_sees_future" in check.message


def test_undeclared_leak_still_fails_causality():
    with attnkit.registered(LeakyFutureAttention, name="kit-selection-undeclared"):
        check = run_conformance("kit-selection-undeclared", checks=["causality"])["causality"]
    assert check.status == "failed" and "leaks the future" in check.message
