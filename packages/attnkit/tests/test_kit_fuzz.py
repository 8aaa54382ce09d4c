"""The kit's fuzz check (hypothesis): deterministic, a clear refusal or the reference, a shrunk reproducer."""

from __future__ import annotations

import sys

import broken_impls
import pytest
import torch

import attnkit
from attnkit.testing import CHECKS, CheckFailed, ConformanceConfig, run_conformance
from attnkit.testing import fuzz as F


def test_the_fuzz_check_is_in_the_kit():
    assert "fuzz" in CHECKS
    from attnkit.testing import AttentionConformance

    assert hasattr(AttentionConformance, "test_fuzz")


def test_softmax_passes_and_reports_its_budget(monkeypatch):
    monkeypatch.delenv("ATTNKIT_FUZZ_EXAMPLES", raising=False)
    report = run_conformance("softmax", checks=["fuzz"])
    assert report["fuzz"].status == "passed", report.format()
    assert f"{F.DEFAULT_EXAMPLES} examples" in report["fuzz"].message
    again = run_conformance("softmax", checks=["fuzz"])
    assert again["fuzz"].message == report["fuzz"].message  # derandomized: the same draws every run


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("ATTNKIT_FUZZ_EXAMPLES", "3")
    assert F.examples_budget() == 3
    report = run_conformance("softmax", checks=["fuzz"])
    assert report["fuzz"].message.startswith("3 examples")
    monkeypatch.setenv("ATTNKIT_FUZZ_EXAMPLES", "many")
    with pytest.raises(ValueError, match="ATTNKIT_FUZZ_EXAMPLES"):
        F.examples_budget()


def test_a_fault_only_other_head_dims_reveal_is_caught_with_a_replayable_reproducer():
    case = next(c for c in broken_impls.CASES if c.check == "fuzz")
    with attnkit.registered(case.cls, name=case.name, family="custom", **case.fields):
        with pytest.raises(CheckFailed, match=case.message) as info:
            CHECKS["fuzz"](ConformanceConfig(name=case.name))
        # the other checks do not see it: the fault needs a head dim below 4
        assert run_conformance(case.name, checks=["reference", "key_padding"]).ok
        line = str(info.value).split("reproduce (shrunk by hypothesis): ", 1)[1]
        with pytest.raises(CheckFailed, match="forward raised IndexError"):
            eval(line, {"attnkit": attnkit})  # the printed reproducer replays the failure


def test_replay_of_a_good_case_matches_and_refusals_are_counted():
    ok = F.FuzzCase(B=2, H=1, L=3, S=5, D=3, E=2, dtype="float64", causal=False,
                    padding=((True,) * 5, (False,) * 5), poison=float("nan"), mask=("window", 1, 0))
    assert F.replay("softmax", ok) == "matched"
    # a causal call with L != S where the spec declares no causal cross-attention: a clear refusal
    refused = F.FuzzCase(B=1, H=1, L=2, S=4, D=2, E=2, dtype="float32", causal=True)
    assert F.replay("linear", refused) == "refused" if "linear" in {s.name for s in attnkit.available()} \
        else F.replay("softmax", refused) == "matched"


def test_without_hypothesis_the_check_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    report = run_conformance("softmax", checks=["fuzz"])
    assert report["fuzz"].status == "skipped" and "hypothesis is not installed" in report["fuzz"].message


def test_option_strategies_follow_the_schema():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    spec = attnkit.get_spec("softmax")
    drawn = {o.name: F._option_strategy(st, o) for o in spec.resolved_options()}
    assert drawn["dropout"] is not None and drawn["scale"] is not None
    assert drawn["backend"] is None or "backend" in F.NOT_DRAWN  # free-form strings are left at their default
    dropout = next(o for o in spec.resolved_options() if o.name == "dropout")

    @settings(max_examples=20, database=None, derandomize=True)
    @given(drawn["dropout"], drawn["scale"])
    def inside(p, scale):
        assert dropout.minimum < p < dropout.maximum
        assert scale is None or scale > 0

    inside()


def test_float64_draws_compare_gradients_with_the_reference():
    with attnkit.registered(broken_impls.DetachedKeysAttention, name="fuzz-detached-keys", family="custom",
                            exact=True, capabilities=broken_impls.BASIC):
        report = run_conformance("fuzz-detached-keys", checks=["fuzz"])
    assert report["fuzz"].status == "failed"
    assert "gradient of k vs reference" in report["fuzz"].message
    assert "dtype='float64'" in report["fuzz"].message  # the reproducer is a float64 draw


class _Float32Drift(attnkit.Attention):
    """Softmax whose float32 path adds 1e-3 to every output: a float32-only fault."""

    capabilities = attnkit.Capabilities(causal=True, key_padding_mask=True)

    def _attend(self, q, k, v, ctx):
        from attnkit.reference import naive_attention

        out = naive_attention(q, k, v, mask=ctx.mask, positions=ctx.positions, scale=ctx.scale)
        return out + 1e-3 if q.dtype == torch.float32 else out


def test_the_float32_conditioning_allowance_does_not_hide_a_float32_fault():
    """float32 draws may be off by 4x the plain reference's own float32 error; a well-conditioned draw
    leaves almost nothing of that allowance, so a float32-only offset of 1e-3 still fails."""
    case = F.FuzzCase(B=1, H=1, L=4, S=4, D=8, E=4, dtype="float32", causal=True)
    with attnkit.registered(_Float32Drift, name="f32-drift", family="custom",
                            reference="attnkit.reference:softmax_reference"):
        with pytest.raises(CheckFailed, match="4x the reference's own error"):
            F.replay("f32-drift", case)
        assert F.replay("f32-drift", F.FuzzCase(**{**case.__dict__, "dtype": "float64"})) == "matched"
