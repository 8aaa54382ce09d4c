"""The conformance kit catches deliberately broken implementations and passes softmax.

Each broken implementation in ``broken_impls.py`` breaks one rule; it is
registered in-process for one test (always unregistered after), and the check
aimed at that rule must fail, both as a plain function (AssertionError) and as
an entry of ``run_conformance``'s report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import broken_impls
import pytest
import torch

import attnkit
from attnkit.testing import (
    CHECKS,
    AttentionConformance,
    CheckFailed,
    ConformanceConfig,
    ConformanceConfigError,
    ErrorDistribution,
    run_conformance,
)
from attnkit.testing.checks import check_error_bound

ISSUE_FIVE = {"broken-leak", "broken-ignores-padding", "broken-nan-row", "broken-streaming",
              "broken-claims-mask"}


@pytest.fixture
def broken(request):
    """Register ``request.param`` (a BrokenCase) for the test; always unregister."""
    case = request.param
    with attnkit.registered(case.cls, name=case.name, family="custom", **case.fields):
        yield case
    with pytest.raises(attnkit.UnknownAttentionError):
        attnkit.get_spec(case.name)


def test_the_five_broken_implementations_of_the_issue_are_covered():
    assert ISSUE_FIVE <= {c.name for c in broken_impls.CASES}
    # and every check has a broken implementation that it must catch
    assert {c.check for c in broken_impls.CASES} == set(CHECKS)


@pytest.mark.parametrize("broken", broken_impls.CASES, ids=lambda c: c.name, indirect=True)
def test_check_catches_broken_implementation(broken):
    cfg = ConformanceConfig(name=broken.name)
    with pytest.raises(AssertionError, match=broken.message) as info:
        CHECKS[broken.check](cfg)
    assert isinstance(info.value, CheckFailed)
    assert str(info.value).startswith(f"[{broken.check}] {broken.name!r}: ")

    report = run_conformance(broken.name, checks=[broken.check])
    assert not report.ok
    result = report[broken.check]
    assert result.status == "failed" and broken.check in result.message


@pytest.mark.parametrize("broken", [c for c in broken_impls.CASES if c.name in ISSUE_FIVE],
                         ids=lambda c: c.name, indirect=True)
def test_full_run_reports_the_fault(broken):
    """The whole kit flags each of the five, and its report is not ok."""
    report = run_conformance(broken.name)
    assert not report.ok
    assert broken.check in {r.check for r in report.failed}, report.format()


def test_softmax_passes_every_check():
    report = run_conformance("softmax")
    assert report.ok, report.format()
    statuses = {r.check: r.status for r in report.results}
    assert list(statuses) == list(CHECKS)
    # softmax declares every capability and is exact: only these do not apply
    assert {c for c, s in statuses.items() if s == "skipped"} == {"refusals", "error_bound", "scaled_inputs",
                                                                  "aux_losses"}
    assert "declares every capability" in report["refusals"].message
    # a passed check may carry a note: what it could not test here
    assert report["state_validation"].message in ("", "not tested: another device: no second device here")


def test_an_implementation_with_an_auxiliary_loss_passes_the_aux_check():
    """The aux_losses check is not vacuous: a correct recorder passes it (and its broken variants fail it)."""
    with attnkit.registered(broken_impls.PenalisedAttention, name="penalised-ok", family="custom", exact=True,
                            capabilities=broken_impls.BASIC, aux_losses={"penalty": 1.0}):
        report = run_conformance("penalised-ok", checks=["aux_losses", "checkpointing", "training_mode",
                                                         "gradients"])
        assert report.ok, report.format()
        assert report["aux_losses"].status == "passed" and report["checkpointing"].status == "passed"


def test_softmax_torch_backend_passes():
    report = run_conformance("softmax", {"backend": "torch"})
    assert report.ok, report.format()


def test_error_bound_passes_a_fair_approximation_and_states_its_distribution():
    with attnkit.registered(broken_impls.SlightlyNoisyAttention, name="fair-approx", exact=False,
                            error_bound=0.01, capabilities=broken_impls.BASIC):
        check_error_bound(ConformanceConfig(name="fair-approx"))
        report = run_conformance("fair-approx", checks=["error_bound", "reference"])
        assert report["error_bound"].status == "passed"
        assert report["reference"].status == "skipped"
        # a tighter bound than the perturbation fails, naming the distribution
        with attnkit.registered(broken_impls.SlightlyNoisyAttention, name="too-tight", exact=False,
                                error_bound=1e-6, capabilities=broken_impls.BASIC):
            with pytest.raises(CheckFailed, match=r"N\(0, 1²\), B=2, H=2, L=S=64, D=E=16, seed 0"):
                check_error_bound(ConformanceConfig(name="too-tight"))


def test_no_error_bound_is_skipped_not_passed():
    with attnkit.registered(broken_impls.SlightlyNoisyAttention, name="unbounded", exact=False,
                            capabilities=broken_impls.BASIC):
        report = run_conformance("unbounded", checks=["error_bound"])
    assert report["error_bound"].status == "skipped"
    assert "declares no error_bound" in report["error_bound"].message


def test_refusals_pass_for_an_honest_narrow_implementation():
    """A naive implementation declaring little: the base class refuses the rest, the kit confirms."""
    caps = attnkit.Capabilities(noncausal=False, key_padding_mask=False, cross=False, dtypes=("float64",))
    with attnkit.registered(broken_impls.NaiveAttention, name="narrow", exact=True, capabilities=caps):
        report = run_conformance("narrow")
    assert report.ok, report.format()
    assert report["refusals"].status == "passed"
    for check in ("key_padding", "cross_attention", "attn_mask", "streaming"):
        assert report[check].status == "skipped", check


def test_configured_skip_is_reported_with_reason():
    report = run_conformance("softmax", checks=["gradcheck", "determinism"],
                             skip={"gradcheck": "too slow here"})
    assert report["gradcheck"].status == "skipped"
    assert "too slow here" in report["gradcheck"].message
    assert report["determinism"].status == "passed"


def test_config_errors_are_loud():
    with pytest.raises(ConformanceConfigError, match="unknown check"):
        run_conformance("softmax", skip={"gradchek": "typo"})
    with pytest.raises(ConformanceConfigError, match="S != L"):
        ConformanceConfig(name="softmax", shapes=(2, 2, 8, 8, 4, 4))
    caps = attnkit.Capabilities(dtypes=("float64",))
    with attnkit.registered(broken_impls.NaiveAttention, name="f64-only", exact=True, capabilities=caps):
        with pytest.raises(ConformanceConfigError, match=r"\['float32'\] not declared"):
            run_conformance("f64-only", checks=["shapes_dtypes"], dtypes=["float32"])
    with pytest.raises(attnkit.UnknownAttentionError):
        run_conformance("no-such-attention")


def test_report_formats_and_serialises():
    with attnkit.registered(broken_impls.LeakyFutureAttention, name="leaky", exact=True,
                            capabilities=broken_impls.BASIC):
        report = run_conformance("leaky", checks=["shapes_dtypes", "causality", "streaming"])
    text = report.format()
    assert text.splitlines()[0].startswith("leaky: 1 passed, 1 failed, 1 skipped")
    assert "FAIL  causality: [causality] 'leaky':" in text and "max |diff|" in text
    d = json.loads(json.dumps(report.as_dict()))
    assert d["ok"] is False and d["failed"] == 1
    assert [c["status"] for c in d["checks"]] == ["passed", "failed", "skipped"]


def test_failure_message_names_case_and_tolerance():
    with attnkit.registered(broken_impls.IgnoresPaddingAttention, name="nopad", exact=True,
                            capabilities=broken_impls.BASIC):
        with pytest.raises(CheckFailed) as info:
            CHECKS["key_padding"](ConformanceConfig(name="nopad"))
    msg = str(info.value)
    for part in ("causal=True", "L=9, S=9", "dtype=float64", "key_padding_mask=", "padded key(s) removed",
                 "max |diff| =", "atol=1e-09", "rtol=1e-07"):
        assert part in msg, (part, msg)


def test_every_check_has_a_test_method():
    methods = {m[len("test_"):] for m in dir(AttentionConformance) if m.startswith("test_")}
    assert methods == set(CHECKS)


def test_suite_needs_a_name():
    class TestNoName(AttentionConformance):
        pass

    with pytest.raises(TypeError, match="set the class attribute name"):
        TestNoName().test_determinism()


def test_kit_leaves_global_state_alone():
    """The caller's RNG stream and intra-op thread count are restored after the checks."""
    threads = torch.get_num_threads()
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    run_conformance("softmax", checks=["determinism", "state_dict"])
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


def test_checks_import_without_pytest():
    code = textwrap.dedent("""
        import sys
        sys.modules["pytest"] = None  # any import of pytest now fails
        import attnkit.testing.checks
        from attnkit.testing import run_conformance
        r = run_conformance("softmax", checks=["shapes_dtypes"])
        assert r.ok, r.format()
        try:
            from attnkit.testing import AttentionConformance
        except ImportError:
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_third_party_subclass_under_pytest(tmp_path: Path):
    """A third party's suite: a subclass with options and a skip; pytest reports failures and skips."""
    tests_dir = Path(__file__).parent
    (tmp_path / "test_third_party.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tests_dir)!r})
        import attnkit
        import broken_impls
        from attnkit.testing import AttentionConformance

        attnkit.register(broken_impls.IgnoresPaddingAttention, name="third-party", exact=True,
                         capabilities=broken_impls.BASIC)

        class TestThirdParty(AttentionConformance):
            name = "third-party"
            options = {{"scale": None}}
            skip = {{"gradcheck": "not today"}}
    """))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    text = out.stdout
    assert out.returncode == 1, text + out.stderr
    assert "FAILED test_third_party.py::TestThirdParty::test_key_padding" in text
    assert "key_padding_mask is not honoured" in text
    assert "gradcheck: skipped by configuration: not today" in text
    assert "attn_mask: the spec does not declare attn_mask" in text
    # ignoring the padding also breaks the reference match; the base zeroes padded keys, so the
    # padded-key gradients and the garbage-at-padded-keys check pass
    assert "FAILED test_third_party.py::TestThirdParty::test_reference" in text
    # and the fuzz check draws padded rows too (with a reproducer)
    assert "FAILED test_third_party.py::TestThirdParty::test_fuzz" in text
    # scaled_inputs: exact spec; aux_losses: none declared; export_dynamic: export not declared
    assert "3 failed, 23 passed, 9 skipped" in text


def test_error_distribution_override():
    dist = ErrorDistribution(length=16, dim=8)
    with attnkit.registered(broken_impls.SlightlyNoisyAttention, name="fair-small", exact=False,
                            error_bound=0.01, capabilities=broken_impls.BASIC):
        report = run_conformance("fair-small", checks=["error_bound"], error_distribution=dist)
    assert report.ok, report.format()


def _per_chunk_causal(attn, q, k, v, chunk):
    """Segment semantics of StreamingMismatchAttention: causal attention within each chunk only."""
    outs = [attn(q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk], causal=True)
            for s in range(0, q.shape[2], chunk)]
    return torch.cat(outs, dim=2)


def test_segment_streaming_uses_the_given_reference():
    caps = attnkit.Capabilities(streaming="segment")
    with attnkit.registered(broken_impls.StreamingMismatchAttention, name="segment-ok", exact=True,
                            capabilities=caps):
        # without a reference: shapes and finiteness only
        assert run_conformance("segment-ok", checks=["streaming"]).ok
        # with the right reference: passes
        report = run_conformance("segment-ok", checks=["streaming"], streaming_reference=_per_chunk_causal)
        assert report.ok, report.format()

        # with a reference it does not meet (the whole causal forward): fails at chunk 1
        def whole(attn, q, k, v, chunk):
            return attn(q, k, v, causal=True)

        report = run_conformance("segment-ok", checks=["streaming"], streaming_reference=whole)
        assert not report.ok
        assert "chunk=1" in report["streaming"].message and "streaming_reference" in report["streaming"].message


class _ValueDimAttention(broken_impls.NaiveAttention):
    """Softmax attention that, like a learned value convolution, only accepts values of its ``value_dim``."""

    def __init__(self, *, num_heads=None, head_dim=None, scale=None, backend="auto", value_dim=None):
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.value_dim = value_dim

    def _forward(self, q, k, v, **kw):
        if v.shape[-1] != self.value_dim:
            raise attnkit.InvalidInputError(f"v: built for E={self.value_dim}, got {tuple(v.shape)}")
        return super()._forward(q, k, v, **kw)


def test_kit_hints_value_dim_to_factories_that_name_it():
    """The kit passes E as ``value_dim`` (only where the factory names it), as it passes H and D."""
    caps = attnkit.Capabilities(noncausal=True, causal=False, key_padding_mask=False, cross=True)
    with attnkit.registered(_ValueDimAttention, name="value-dim", exact=True, capabilities=caps):
        report = run_conformance("value-dim", checks=["shapes_dtypes", "reference", "fuzz"],
                                 shapes=(2, 2, 9, 12, 8, 5))
        assert report.ok, report.format()
        explicit = run_conformance("value-dim", checks=["shapes_dtypes"], options={"value_dim": 3})
    assert explicit["shapes_dtypes"].status == "failed"      # an explicit option wins over the hint
    assert "built for E=3" in explicit["shapes_dtypes"].message
