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


class FakeDistribution:
    """What discovery reads of an entry point's distribution: its name and version."""

    def __init__(self, name: str, version: str = "1.0") -> None:
        self.metadata = {"Name": name}
        self.version = version


def entry_point(name: str, module: str, distribution: str | None = None) -> metadata.EntryPoint:
    """An entry point of the plugin group, owned by a fake distribution when one is named."""
    ep = metadata.EntryPoint(name=name, value=module, group=GROUP)
    if distribution is not None:
        object.__setattr__(ep, "dist", FakeDistribution(distribution))  # EntryPoint is otherwise immutable
    return ep


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Call with ``{name: "module"}``, ``{name: ("module", "distribution")}`` or a list of
    ``(name, "module", "distribution")`` (two distributions may share an entry-point name);
    returns a fresh Registry that sees only those plugins."""
    for var in ("ATTNKIT_PLUGINS", "ATTNKIT_DISABLE_PLUGINS", "ATTNKIT_STRICT_PLUGINS", "ATTNKIT_BACKEND"):
        monkeypatch.delenv(var, raising=False)

    def make(mapping: dict[str, str | tuple[str, str]] | list[tuple[str, str, str]]) -> Registry:
        items = mapping if isinstance(mapping, list) else [
            (n, v, None) if isinstance(v, str) else (n, *v) for n, v in mapping.items()]
        eps = metadata.EntryPoints(entry_point(*item) for item in items)
        monkeypatch.setattr(plugins_mod.metadata, "entry_points",
                            lambda group=None: eps if group == GROUP else metadata.EntryPoints(()))
        return Registry()

    return make


@pytest.fixture
def no_plugins(fake_entry_points):
    """A registry holding only the built-in softmax."""
    return fake_entry_points({})
