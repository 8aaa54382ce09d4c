"""Configuring the kit: registry=, queries_interact, state_detached, notes of passed checks."""

from __future__ import annotations

import broken_impls
import pytest

import attnkit
from attnkit.registry import default_registry
from attnkit.testing import AttentionConformance, ConformanceConfig, run_conformance

STREAMING = attnkit.Capabilities(streaming="exact")


def test_config_defaults_to_the_default_registry():
    assert ConformanceConfig(name="softmax").registry is default_registry()


def test_run_conformance_on_another_registry(no_plugins):
    """A name registered only in another registry: resolved and built there, unknown to the default one."""
    no_plugins.register(broken_impls.NaiveAttention, name="kit-elsewhere", exact=True, capabilities=STREAMING)
    with pytest.raises(attnkit.UnknownAttentionError):
        run_conformance("kit-elsewhere", checks=["shapes_dtypes"])
    report = run_conformance("kit-elsewhere", registry=no_plugins)
    assert report.ok, report.format()
    assert report["reference"].status == "passed" and report["state_validation"].status == "passed"


def test_suite_passes_registry_and_flags_through():
    class TestSome(AttentionConformance):
        name = "softmax"
        registry = default_registry()
        queries_interact = True
        long_length = None

    cfg = TestSome().conformance_config()
    assert cfg.registry is default_registry() and cfg.queries_interact and cfg.long_length is None


def test_queries_interact_skips_the_nan_query_check_with_its_reason():
    case = next(c for c in broken_impls.CASES if c.name == "broken-query-mixing")
    with attnkit.registered(case.cls, name="kit-mixing", **case.fields):
        report = run_conformance("kit-mixing", checks=["nan_queries"], queries_interact=True)
    assert report["nan_queries"].status == "skipped"
    assert "queries_interact=True" in report["nan_queries"].message


def test_detached_states_are_not_held_to_gradients_across_chunks():
    caps = attnkit.Capabilities(streaming="exact", state_detached=True)
    with attnkit.registered(broken_impls.DetachedCacheAttention, name="kit-detached", exact=True, capabilities=caps):
        report = run_conformance("kit-detached", checks=["streaming", "state_validation"])
    assert report.ok, report.format()


def test_state_validation_says_what_it_could_not_test():
    caps = attnkit.Capabilities(streaming="exact", dtypes=("float64",))
    with attnkit.registered(broken_impls.NaiveAttention, name="kit-f64-stream", exact=True, capabilities=caps):
        report = run_conformance("kit-f64-stream", checks=["state_validation"])
    r = report["state_validation"]
    assert r.status == "passed" and "another dtype: only one dtype declared" in r.message


def test_long_length_can_be_left_out():
    report = run_conformance("softmax", checks=["reference", "causality"], long_length=None)
    assert report.ok, report.format()


def test_skip_accepts_the_new_check_names():
    report = run_conformance("softmax", checks=["padded_values", "nan_queries"],
                             skip={"padded_values": "not here", "nan_queries": "not here"})
    assert [r.status for r in report.results] == ["skipped", "skipped"]
