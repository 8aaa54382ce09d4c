"""Fixtures: a fresh registry fed by fake entry points, so installed plugins never leak in."""

from __future__ import annotations

from importlib import metadata

import pytest

from attnkit import plugins as plugins_mod
from attnkit.registry import Registry

GROUP = "attnkit.plugins"


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path_factory, monkeypatch):
    """Every test sees an empty measured-backend cache: a developer's `attnkit tune` never changes a result."""
    monkeypatch.setenv("ATTNKIT_CACHE_DIR", str(tmp_path_factory.mktemp("attnkit-cache")))


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Call with {name: "module"}; returns a fresh Registry that sees only those plugins."""
    for var in ("ATTNKIT_PLUGINS", "ATTNKIT_DISABLE_PLUGINS", "ATTNKIT_STRICT_PLUGINS"):
        monkeypatch.delenv(var, raising=False)

    def make(mapping: dict[str, str]) -> Registry:
        eps = metadata.EntryPoints(
            metadata.EntryPoint(name=n, value=v, group=GROUP) for n, v in mapping.items()
        )
        monkeypatch.setattr(plugins_mod.metadata, "entry_points",
                            lambda group=None: eps if group == GROUP else metadata.EntryPoints(()))
        return Registry()

    return make


@pytest.fixture
def no_plugins(fake_entry_points):
    """A registry holding only the built-in softmax."""
    return fake_entry_points({})
