"""The attnkit command line, with plugins fed through a fresh registry."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnkit.cli import main


def run(capsys, argv, reg=None):
    code = main(argv, registry=reg)
    out, err = capsys.readouterr()
    return code, out, err


def test_list_table_and_broken_plugin(capsys, fake_entry_points):
    reg = fake_entry_points({"good": "plugin_fixtures.good", "bad": "plugin_fixtures.broken_import"})
    code, out, _ = run(capsys, ["list"], reg)
    assert code == 0
    assert "softmax (exact)" in out and "doubled (twice)" in out
    assert "plugins that failed to load" in out and "bad" in out and "not installed" in out


def test_list_json(capsys, fake_entry_points):
    reg = fake_entry_points({"bad": "plugin_fixtures.broken_import"})
    code, out, _ = run(capsys, ["list", "--json"], reg)
    data = json.loads(out)
    assert code == 0
    assert [a["name"] for a in data["attention"]] == ["softmax"]
    assert {p["name"]: p["status"] for p in data["plugins"]} == {"attnkit": "loaded", "bad": "broken"}


def test_describe_json_has_capabilities_and_options(capsys, no_plugins):
    code, out, _ = run(capsys, ["describe", "softmax", "--json"], no_plugins)
    d = json.loads(out)
    assert code == 0
    assert d["capabilities"]["streaming"] == "exact"
    assert {o["name"] for o in d["options"]} >= {"scale", "backend", "dropout"}
    assert d["paper"]["arxiv"] == "1706.03762"


def test_describe_text(capsys, no_plugins):
    code, out, _ = run(capsys, ["describe", "exact"], no_plugins)
    assert code == 0 and "softmax — Exact" in out and "dropout: float = 0.0" in out


def test_unknown_name_is_a_clean_usage_error(capsys, no_plugins):
    code, out, err = run(capsys, ["describe", "sofmax"], no_plugins)
    assert code == 2 and out == ""
    assert err.startswith("attnkit describe: error: no attention named 'sofmax'")
    assert "Traceback" not in err


def test_plugin_command_is_added_through_the_hook(capsys, fake_entry_points):
    reg = fake_entry_points({"good": "plugin_fixtures.good"})
    code, out, _ = run(capsys, ["hello", "--who", "attnkit"], reg)
    assert code == 0 and out.strip() == "hello attnkit"


def test_no_command_prints_help(capsys, no_plugins):
    code, out, _ = run(capsys, [], no_plugins)
    assert code == 2 and "list" in out and "describe" in out


def test_bad_option_syntax(capsys, no_plugins):
    code, _, err = run(capsys, ["check", "softmax", "-o", "novalue"], no_plugins)
    assert code == 2 and "expected KEY=VALUE" in err


def test_strict_loading_failure_is_reported(capsys, fake_entry_points, monkeypatch):
    reg = fake_entry_points({"bad": "plugin_fixtures.broken_import"})
    monkeypatch.setenv("ATTNKIT_STRICT_PLUGINS", "1")
    code, _, err = run(capsys, ["list"], reg)
    assert code == 2 and "plugin 'bad' failed to load" in err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "attnkit", "describe", "softmax", "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["name"] == "softmax"


@pytest.mark.parametrize("argv", [["--version"]])
def test_version(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "attnkit 0.1.0" in capsys.readouterr().out
