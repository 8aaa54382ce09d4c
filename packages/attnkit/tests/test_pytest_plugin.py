"""`pytest --attnkit-check NAME`: the conformance kit as a pytest plugin (pytest11 entry point)."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest

from attnkit.testing import CHECKS

pytest_plugins = ["pytester"]

TESTS = Path(__file__).parent

# registers a deliberately broken attention for the run, and removes it after (in-process runs share the registry)
BROKEN_CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import attnkit
import broken_impls

SPEC = attnkit.register(broken_impls.LeakyFutureAttention, name="leaky-kit-plugin", exact=True,
                        capabilities=broken_impls.BASIC)


def pytest_unconfigure(config):
    attnkit.unregister(SPEC)
"""


def test_the_entry_point_names_the_plugin():
    eps = [e for e in metadata.entry_points(group="pytest11") if e.name == "attnkit"]
    assert [e.value for e in eps] == ["attnkit_pytest"]


def test_importing_the_plugin_imports_neither_torch_nor_attnkit():
    code = ("import sys, attnkit_pytest; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'attnkit', 'attnkit_kernelized', "
            "'attnkit_sparse')], 'imported too much'; "
            "print('ok')")
    import subprocess

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_without_the_option_nothing_is_added(pytester):
    pytester.makepyfile(test_plain="def test_one():\n    assert 1 + 1 == 2\n")
    res = pytester.runpytest("--collect-only", "-q")
    res.assert_outcomes()
    lines = [ln for ln in res.outlines if "::" in ln]
    assert lines == ["test_plain.py::test_one"]
    res = pytester.runpytest()
    res.assert_outcomes(passed=1)


def test_the_option_generates_the_whole_kit_per_name(pytester):
    pytester.makepyfile(test_plain="def test_one():\n    assert True\n")
    res = pytester.runpytest("--collect-only", "-q", "--attnkit-check", "softmax", "--attnkit-check",
                             "softmax@scale=0.5")
    items = [ln for ln in res.outlines if "test_attnkit_conformance[" in ln]
    assert len(items) == 2 * len(CHECKS)
    assert any(ln.endswith("[softmax-causality]") for ln in items)
    assert any(ln.endswith("[softmax,scale=0.5-reference]") for ln in items)
    assert any(ln.endswith("test_plain.py::test_one") for ln in res.outlines)


def test_a_broken_mechanism_is_caught(pytester):
    pytester.makeconftest(BROKEN_CONFTEST)
    res = pytester.runpytest("--attnkit-check", "leaky-kit-plugin", "-k", "causality or shapes_dtypes")
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*test_attnkit_conformance?leaky-kit-plugin-causality?*",
                              "*[[]causality[]] 'leaky-kit-plugin'*"])


def test_softmax_passes_a_check_and_skips_with_reasons(pytester):
    res = pytester.runpytest("--attnkit-check", "softmax", "-k", "causality or error_bound", "-rs")
    res.assert_outcomes(passed=1, skipped=1)
    res.stdout.fnmatch_lines(["*error_bound: *exact*"])


def test_the_fixtures_give_the_built_mechanism(pytester):
    pytester.makepyfile(test_fixture="""
import attnkit, torch

def test_built(attnkit_mechanism, attnkit_name, attnkit_build):
    assert isinstance(attnkit_mechanism, attnkit.Attention) and not attnkit_mechanism.training
    assert attnkit_mechanism.spec.name == attnkit_name == "softmax"
    assert attnkit_mechanism.scale == 0.5
    assert attnkit_build(scale=2.0).scale == 2.0
    q = torch.randn(1, 2, 5, 4)
    assert attnkit_mechanism(q, q, q, causal=True).shape == (1, 2, 5, 4)
""")
    res = pytester.runpytest("--attnkit-check", "softmax@scale=0.5", "-k", "test_built")
    res.assert_outcomes(passed=1)
    res = pytester.runpytest("-k", "test_built")            # no option: a clear error, not a silent skip
    res.assert_outcomes(errors=1)
    res.stdout.fnmatch_lines(["*need --attnkit-check NAME*"])


@pytest.mark.parametrize("entry, words", [
    ("no-such-attention", ["no-such-attention"]),
    ("softmax@nope=1", ["has no option 'nope'", "scale"]),
    ("softmax@scale", ["must be key=value"]),
])
def test_bad_names_and_options_are_usage_errors(pytester, entry, words):
    res = pytester.runpytest("--attnkit-check", entry)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    err = res.stderr.str()
    assert f"--attnkit-check {entry!r}" in err
    for w in words:
        assert w in err, err
