"""Agreement with the spec's own reference is the kit's correctness test; error vs softmax is a figure."""

from __future__ import annotations

import broken_impls
import pytest
import torch

import attnkit
from attnkit.testing import AttentionConformance, CheckFailed, CheckSkipped, ConformanceConfig, run_conformance
from attnkit.testing.checks import check_reference

LOCAL = {"exact": False, "reference": broken_impls.local_reference, "capabilities": broken_impls.LOCAL_CAPS}


class TestLocalAttentionConformance(AttentionConformance):
    """A correct non-softmax mechanism with its own reference passes the whole kit (registered per class)."""

    name = "kit-local"

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _registered(cls):
        with attnkit.registered(broken_impls.LocalAttention, name="kit-local", **LOCAL):
            yield


def test_reference_sees_the_module_float64_inputs_and_resolved_masks():
    seen = []

    def spy(attn, q, k, v, *, mask, positions):
        seen.append((attn, q.dtype, k.dtype, v.dtype, mask, positions))
        return broken_impls.local_reference(attn, q, k, v, mask=mask, positions=positions)

    with attnkit.registered(broken_impls.LocalAttention, name="kit-local-spy", exact=False, reference=spy,
                            capabilities=broken_impls.LOCAL_CAPS):
        check_reference(ConformanceConfig(name="kit-local-spy"))
    assert seen
    assert all(isinstance(a, broken_impls.LocalAttention) and a.window == 2 for a, *_ in seen)
    assert all(dt == torch.float64 for _, q, k, v, _, _ in seen for dt in (q, k, v))
    kinds = {k for *_, m, _ in seen if m is not None for k in m.kinds}
    assert kinds == {"causal", "key_padding", "sliding_window"}
    assert any(m is None for *_, m, _ in seen)  # the unmasked case too


def test_no_reference_is_skipped_with_the_reason():
    with attnkit.registered(broken_impls.SlightlyNoisyAttention, name="kit-no-ref", exact=False,
                            capabilities=broken_impls.BASIC):
        with pytest.raises(CheckSkipped, match="names no reference"):
            check_reference(ConformanceConfig(name="kit-no-ref"))


def test_a_raising_reference_fails_naming_it():
    def bad(attn, q, k, v, *, mask, positions):
        raise RuntimeError("boom")

    with attnkit.registered(broken_impls.LocalAttention, name="kit-bad-ref", exact=False, reference=bad,
                            capabilities=broken_impls.LOCAL_CAPS):
        with pytest.raises(CheckFailed, match=r"the spec's reference .* raised RuntimeError: boom"):
            check_reference(ConformanceConfig(name="kit-bad-ref"))


def test_config_tolerances_loosen_the_reference():
    """A 0.1 % perturbation fails the tight default and passes a configured tolerance."""
    with attnkit.registered(broken_impls.SlightlyNoisyAttention, name="kit-noisy", exact=True,
                            capabilities=broken_impls.BASIC):
        with pytest.raises(CheckFailed, match="output vs reference"):
            check_reference(ConformanceConfig(name="kit-noisy"))
        loose = {"float64": 1e-2, "float32": 1e-2}
        report = run_conformance("kit-noisy", checks=["reference"], atol=loose, rtol=loose)
        assert report.ok, report.format()


def test_every_backend_is_held_to_the_reference():
    """The fault lives only on the second backend; the reference check names it."""
    case = next(c for c in broken_impls.CASES if c.name == "broken-one-backend")
    with attnkit.registered(case.cls, name="kit-one-backend", **case.fields):
        report = run_conformance("kit-one-backend", checks=["reference"])
        assert not report.ok and "backend='kitfake'" in report["reference"].message
        # a backend forced in the options does not hide the others: each declared one is forced in turn
        forced = run_conformance("kit-one-backend", {"backend": "torch"}, checks=["reference"])
        assert not forced.ok and "backend='kitfake'" in forced["reference"].message


def test_error_bound_is_a_reported_figure():
    with attnkit.registered(broken_impls.SlightlyNoisyAttention, name="kit-fair", exact=False, error_bound=0.01,
                            capabilities=broken_impls.BASIC):
        report = run_conformance("kit-fair", checks=["error_bound"])
    r = report["error_bound"]
    assert r.status == "passed"
    assert r.message.startswith("error vs softmax causal=False: ") and "declared bound 0.01" in r.message
    assert "error vs softmax" in report.format()


def test_a_correct_contract_1_implementation_with_attn_mask_passes():
    with attnkit.registered(broken_impls.NaiveAttention, name="kit-v1-mask", exact=True,
                            capabilities=attnkit.Capabilities(attn_mask=True)):
        report = run_conformance("kit-v1-mask", checks=["mask_objects", "reference"])
    assert report.ok, report.format()
