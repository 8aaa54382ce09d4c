"""Plugin discovery and loading.

Plugins are modules named by entry points in the ``attnkit.plugins`` group.
Loading is per-plugin isolated: a plugin that fails to import, has a bad hook,
or was built for another API major version is recorded with its error and
skipped; the rest keep working. Environment variables, read at load time:

* ``ATTNKIT_PLUGINS``: comma-separated allow-list; set but empty means no
  external plugin.
* ``ATTNKIT_DISABLE_PLUGINS``: comma-separated block-list.

An entry of either list is a distribution name (``attnkit-kernelized``), a
``distribution:entry-point`` pair (``attnkit-kernelized:kernelized``), or a
bare entry-point name (``kernelized``). Distribution names compare as pip
does (case-insensitive; ``-``, ``_`` and ``.`` alike). Entry-point names are
not unique across distributions: a bare name that two distributions use
matches neither (with a warning that names the qualified spellings), so an
allow- or block-list never selects a plugin by accident. An entry that
matches no installed plugin is warned about (a typo would otherwise load
nothing, or block nothing, silently).

* ``ATTNKIT_STRICT_PLUGINS=1``: a load failure raises :class:`PluginLoadError`.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any

from ._version import API_VERSION
from .errors import PluginLoadError

ENTRY_POINT_GROUP = "attnkit.plugins"
ENV_ALLOW = "ATTNKIT_PLUGINS"
ENV_BLOCK = "ATTNKIT_DISABLE_PLUGINS"
ENV_STRICT = "ATTNKIT_STRICT_PLUGINS"


@dataclass
class PluginRecord:
    """What happened to one plugin: ``loaded``, ``broken``, ``blocked`` or ``skipped``."""

    name: str
    distribution: str
    version: str
    module: str
    status: str
    error: str = ""
    object: Any = None

    def as_dict(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in ("name", "distribution", "version", "module", "status", "error")}


def _env_list(var: str) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return [p.strip() for p in raw.split(",") if p.strip()]


def strict() -> bool:
    return os.environ.get(ENV_STRICT, "").strip().lower() in ("1", "true", "yes", "on")


def check_api_version(module: ModuleType | Any, plugin: str) -> str | None:
    """None when the plugin's declared API version fits, else the reason."""
    declared = getattr(module, "ATTNKIT_API_VERSION", None)
    if declared is None:
        return None
    try:
        major = int(str(declared).split(".")[0])
    except ValueError:
        return f"ATTNKIT_API_VERSION must be an int, got {declared!r}"
    if major != API_VERSION:
        if major > API_VERSION:
            fix = "upgrade attnkit (pip install -U attnkit)"
        else:
            fix = f"upgrade the plugin (pip install -U {plugin}) to one built for API {API_VERSION}"
        return (f"built for attnkit plugin API {major}, this attnkit provides API {API_VERSION}: {fix}")
    return None


def discover() -> list[tuple[PluginRecord, metadata.EntryPoint | None]]:
    """Entry points of the group, with their allow/block status (nothing imported)."""
    allow = _env_list(ENV_ALLOW)
    block = _env_list(ENV_BLOCK) or []
    eps = []
    seen = set()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        dist_name = (dist.metadata["Name"] if dist is not None else "") or ""
        version = (dist.version if dist is not None else "") or ""
        key = (ep.name, ep.value)
        if key in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add(key)
        eps.append((ep, dist_name, version))
    owners: dict[str, set[str]] = {}
    for ep, dist_name, _ in eps:
        owners.setdefault(ep.name, set()).add(dist_name)
    keys = {}
    for ep, dist_name, _ in eps:
        bare_ok = len(owners.get(ep.name, ())) == 1
        keys[(ep.name, ep.value)] = ({_norm(dist_name), f"{_norm(dist_name)}:{ep.name}"} - {"", f":{ep.name}"}) \
            | ({ep.name} if bare_ok else set())
    every = set().union(*keys.values()) if keys else set()
    for var, entries in ((ENV_ALLOW, allow or []), (ENV_BLOCK, block)):
        for e in entries:
            if ":" not in e and len(owners.get(e, ())) > 1:
                spell = ", ".join(f"{d}:{e}" for d in sorted(owners[e]))
                warnings.warn(f"{var}: the entry-point name {e!r} is used by several distributions and matches "
                              f"none of them; write one of: {spell}", RuntimeWarning, stacklevel=2)
            elif not _entry_keys(e) & every:
                installed = sorted({f"{d}:{ep.name}" if d else ep.name for ep, d, _ in eps})
                warnings.warn(f"{var}: {e!r} matches no installed plugin (installed: {installed or 'none'}); "
                              "write a distribution name, distribution:entry-point, or an entry-point name",
                              RuntimeWarning, stacklevel=2)
    allow_keys = None if allow is None else set().union(*(_entry_keys(e) for e in allow))
    block_keys = set().union(*(_entry_keys(e) for e in block))
    found = []
    for ep, dist_name, version in eps:
        rec = PluginRecord(ep.name, dist_name, version, ep.value, "pending")
        names = keys[(ep.name, ep.value)]
        if names & block_keys:
            rec.status, rec.error = "blocked", f"blocked by {ENV_BLOCK}"
        elif allow_keys is not None and not names & allow_keys:
            rec.status, rec.error = "blocked", f"not in {ENV_ALLOW}"
        found.append((rec, ep))
    return found


def _norm(dist: str) -> str:
    """A distribution name as pip compares it (PEP 503): lower case, runs of ``-_.`` as ``-``."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def _entry_keys(entry: str) -> set[str]:
    """What an allow/block-list entry may match: ``dist:ep`` with the distribution normalised; a bare
    entry as an entry-point name (as written) or as a distribution name (normalised)."""
    dist, sep, ep = entry.rpartition(":")
    return {f"{_norm(dist)}:{ep}"} if sep else {entry, _norm(entry)}


def load_entry_point(rec: PluginRecord, ep: metadata.EntryPoint) -> None:
    """Import one plugin module into ``rec.object`` or record why it failed."""
    try:
        module = ep.load()
    except BaseException as exc:  # noqa: BLE001 - a plugin must never take the others down (sys.exit too)
        if isinstance(exc, KeyboardInterrupt):
            raise
        fail(rec, f"import failed: {type(exc).__name__}: {exc}")
        return
    reason = check_api_version(module, rec.distribution or rec.name)
    if reason is not None:
        rec.status, rec.error = "skipped", reason
        warnings.warn(f"attnkit plugin {rec.name!r} skipped: {reason}", RuntimeWarning, stacklevel=3)
        if strict():
            raise PluginLoadError(rec.name, reason)
        return
    rec.object = module
    rec.status = "loaded"


def fail(rec: PluginRecord, reason: str) -> None:
    """Mark a plugin broken; raise under ATTNKIT_STRICT_PLUGINS."""
    rec.status, rec.error = "broken", reason
    if strict():
        raise PluginLoadError(rec.name, reason)
