"""A third-party distribution, installed with pip, is found through its entry point."""

from __future__ import annotations

import re
import subprocess
import sys

import torch
from conftest import FIXTURES, attnkit_cli, listed

import attnkit
from attnkit.testing import CHECKS


def test_selected_by_name_in_process():
    attn = attnkit.build("plain-softmax")
    spec = attn.spec
    assert spec.distribution == "attnkit-thirdparty" and spec.version == "0.3.0"
    q = torch.randn(2, 2, 6, 4)
    torch.testing.assert_close(attn(q, q, q, causal=True), attnkit.build("softmax")(q, q, q, causal=True))


def test_shown_by_attnkit_list():
    data = listed()
    names = {a["name"]: a for a in data["attention"]}
    assert names["plain-softmax"]["distribution"] == "attnkit-thirdparty"
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["thirdparty"]["status"] == "loaded"
    table = attnkit_cli("list").stdout
    assert "plain-softmax" in table and "attnkit-thirdparty 0.3.0" in table


def test_attnkit_check_passes_on_it():
    res = attnkit_cli("check", "plain-softmax")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 of 1 implementation(s) conform" in res.stdout


def test_blocked_by_env_var():
    data = listed({"ATTNKIT_DISABLE_PLUGINS": "thirdparty"})
    assert "plain-softmax" not in {a["name"] for a in data["attention"]}
    assert {p["name"]: p["status"] for p in data["plugins"]}["thirdparty"] == "blocked"
    res = attnkit_cli("describe", "plain-softmax", env={"ATTNKIT_DISABLE_PLUGINS": "attnkit-thirdparty"})
    assert res.returncode == 2 and "no attention named 'plain-softmax'" in res.stderr


def test_allow_list_env_var():
    data = listed({"ATTNKIT_PLUGINS": "thirdparty"})
    assert {a["distribution"] for a in data["attention"]} == {"attnkit", "attnkit-thirdparty"}


def test_disappears_when_uninstalled(thirdparty_uninstalled):
    data = listed()
    assert "plain-softmax" not in {a["name"] for a in data["attention"]}
    assert "thirdparty" not in {p["name"] for p in data["plugins"]}


def test_broken_plugin_is_reported_and_isolated(broken_plugin_installed):
    env = {"ATTNKIT_STRICT_PLUGINS": "0"}
    res = attnkit_cli("list", env=env)
    assert res.returncode == 0, res.stderr
    assert "plugins that failed to load" in res.stdout
    assert "brokenplugin" in res.stdout and "attnkit_dependency_that_does_not_exist" in res.stdout
    assert "plain-softmax" in res.stdout and "softmax" in res.stdout  # the rest keep working
    data = listed(env)
    assert {p["name"]: p["status"] for p in data["plugins"]}["brokenplugin"] == "broken"
    strict = attnkit_cli("list", env={"ATTNKIT_STRICT_PLUGINS": "1"})
    assert strict.returncode == 2 and "plugin 'brokenplugin' failed to load" in strict.stderr


def test_its_own_suite_runs_the_kit_through_the_pytest_option():
    """The third party's pytest configuration says `addopts = --attnkit-check plain-softmax`, nothing more."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs"],
                         cwd=FIXTURES / "attnkit-thirdparty", capture_output=True, text=True)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    kit = re.findall(r"test_attnkit_conformance\[plain-softmax-(\w+)\] (PASSED|SKIPPED)", out)
    assert sorted(c for c, _ in kit) == sorted(CHECKS), out
    assert ("reference", "PASSED") in kit and ("causality", "PASSED") in kit
    assert "test_agrees_with_attnkit_softmax[plain-softmax] PASSED" in out
