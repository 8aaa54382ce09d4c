"""Integration fixtures: pip (un)install of fixture distributions in the session's venv.

These tests change the environment they run in; the ``integration`` nox session
gives them a venv of their own. Every fixture restores what it changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(os.environ.get("ATTNKIT_FIXTURES", Path(__file__).parent / "fixtures"))
# the fixture distributions' own tests run in their own pytest process (test_thirdparty_plugin.py), with their config
collect_ignore = ["fixtures"]
CONSTRAINTS = os.environ.get("ATTNKIT_CONSTRAINTS", str(Path(__file__).parents[1] / "constraints.txt"))


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def attnkit_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``attnkit`` in a fresh process (plugins are discovered anew)."""
    full_env = {**os.environ, **(env or {})}
    for k, v in list(full_env.items()):
        if v is None:
            del full_env[k]
    return subprocess.run([sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, env=full_env)


def listed(env: dict[str, str] | None = None) -> dict:
    res = attnkit_cli("list", "--json", env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture
def broken_plugin_installed():
    pip("install", "--no-deps", "-c", CONSTRAINTS, str(FIXTURES / "attnkit-brokenplugin"))
    try:
        yield
    finally:
        pip("uninstall", "-y", "attnkit-brokenplugin")


@pytest.fixture
def thirdparty_uninstalled():
    pip("uninstall", "-y", "attnkit-thirdparty")
    try:
        yield
    finally:
        pip("install", "--no-deps", "-c", CONSTRAINTS, str(FIXTURES / "attnkit-thirdparty"))
