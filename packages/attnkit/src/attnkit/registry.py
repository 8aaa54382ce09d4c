"""The registry: specs from plugins and in-process registrations, lookup, build.

Loading is lazy (first use) and cached; :func:`reload` forgets it (after a
``pip install`` in the same process, or in tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pluggy

from . import backends as _backends
from . import hookspecs
from ._version import __version__
from .attention import Attention, set_registry_provider
from .errors import (
    AmbiguousNameError,
    InvalidInputError,
    PluginLoadError,
    UnknownAttentionError,
)
from .layers import Block
from .options import check_options
from .plugins import PluginRecord, check_api_version, discover, fail, load_entry_point
from .spec import AttentionSpec, BlockSpec, Capabilities

LOCAL = "local"  # plugin/distribution name of in-process registrations
_SPEC_FIELDS = {f.name for f in dataclasses.fields(AttentionSpec)}
_CAP_FIELDS = {f.name for f in dataclasses.fields(Capabilities)}


def make_spec(spec_or_class: Any, fields: dict[str, Any]) -> AttentionSpec:
    """Turn ``register``'s arguments into an :class:`AttentionSpec`."""
    unknown = set(fields) - _SPEC_FIELDS
    if unknown:
        raise InvalidInputError(
            f"register: unknown spec field(s) {sorted(unknown)}; valid fields: {sorted(_SPEC_FIELDS)}"
        )
    if isinstance(spec_or_class, AttentionSpec):
        return dataclasses.replace(spec_or_class, **fields) if fields else spec_or_class
    if inspect.isclass(spec_or_class) and issubclass(spec_or_class, Attention):
        cls = spec_or_class
        if "name" not in fields:
            raise InvalidInputError(f"register: registering class {cls.__name__} needs name=..., got none")
        doc = (inspect.getdoc(cls) or "").strip().splitlines()
        defaults = {
            "factory": cls,
            "family": "custom",
            "summary": doc[0] if doc else cls.__name__,
            "capabilities": cls.capabilities or Capabilities(),
        }
        return AttentionSpec(**{**defaults, **fields})
    raise InvalidInputError(
        "register: expected an AttentionSpec or an attnkit.Attention subclass, "
        f"got {type(spec_or_class).__name__} {spec_or_class!r}"[:200]
    )


class Registry:
    """Holds the plugin manager, plugin records and specs."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._loaded = False
        self._pm: pluggy.PluginManager | None = None
        self._records: dict[str, PluginRecord] = {}
        self._plugin_specs: dict[str, list[AttentionSpec]] = {}
        self._plugin_blocks: dict[str, list[BlockSpec]] = {}
        self._local: list[AttentionSpec] = []
        self._local_blocks: list[BlockSpec] = []

    # -------------------------------------------------------------- loading
    def _new_manager(self) -> pluggy.PluginManager:
        pm = pluggy.PluginManager("attnkit")
        pm.add_hookspecs(hookspecs)
        return pm

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._pm = self._new_manager()
            self._records = {}
            self._plugin_specs = {}
            self._plugin_blocks = {}
            from . import builtin

            self._add(builtin, PluginRecord("attnkit", "attnkit", __version__, builtin.__name__, "loaded"))
            for rec, ep in discover():
                if rec.name in self._records:
                    fail(rec, f"another plugin is already registered as {rec.name!r}")
                    self._records[f"{rec.name}@{rec.distribution}"] = rec
                    continue
                if rec.status == "blocked":
                    self._records[rec.name] = rec
                    continue
                load_entry_point(rec, ep)
                if rec.status == "loaded":
                    self._add(rec.object, rec)
                else:
                    self._records[rec.name] = rec
            self._loaded = True

    def _add(self, obj: Any, rec: PluginRecord) -> None:
        """Register a plugin object with pluggy and collect its specs, isolated."""
        assert self._pm is not None
        self._records[rec.name] = rec
        rec.object = obj
        try:
            self._pm.register(obj, name=rec.name)
        except Exception as exc:  # pluggy validation: a malformed hook
            fail(rec, f"invalid hook implementation: {exc}")
            return
        unknown = _unknown_hooks(self._pm, obj)
        if unknown:
            self._pm.unregister(name=rec.name)
            fail(rec, _unknown_hooks_message(unknown))
            return
        collected: list[AttentionSpec] = []
        blocks: list[BlockSpec] = []

        def register(spec_or_class: Any, **fields: Any) -> AttentionSpec:
            spec = make_spec(spec_or_class, fields)
            spec = dataclasses.replace(
                spec, plugin=rec.name, distribution=rec.distribution, version=rec.version
            )
            for other in collected:
                if {other.name, *other.aliases} & {spec.name, *spec.aliases}:
                    raise InvalidInputError(
                        f"register: plugin {rec.name!r} registers {spec.name!r} twice (or an alias clashes "
                        f"with {other.name!r})"
                    )
            collected.append(spec)
            return spec

        def register_block(spec: Any) -> BlockSpec:
            if not isinstance(spec, BlockSpec):
                raise InvalidInputError(
                    f"register (attnkit_register_block): expected an attnkit.BlockSpec, got {type(spec).__name__}")
            spec = dataclasses.replace(spec, plugin=rec.name, distribution=rec.distribution, version=rec.version)
            for other in blocks:
                if {other.name, *other.aliases} & {spec.name, *spec.aliases}:
                    raise InvalidInputError(f"register: plugin {rec.name!r} registers block {spec.name!r} twice")
            blocks.append(spec)
            return spec

        for hook, fn in ((self._pm.hook.attnkit_register_attention, register),
                         (self._pm.hook.attnkit_register_block, register_block)):
            for impl in hook.get_hookimpls():
                if impl.plugin_name != rec.name:
                    continue
                try:
                    impl.function(**{a: fn for a in impl.argnames})
                except (PluginLoadError, KeyboardInterrupt):
                    raise
                except BaseException as exc:  # noqa: BLE001 - isolation, sys.exit() included
                    self._pm.unregister(name=rec.name)
                    fail(rec, f"{hook.name} raised {type(exc).__name__}: {exc}")
                    return
        self._plugin_specs[rec.name] = collected
        self._plugin_blocks[rec.name] = blocks
        _backends.declare_backends(b for s in collected for b in s.capabilities.backends)

    def reload(self) -> None:
        """Forget loaded plugins; the next use discovers them again. In-process registrations stay."""
        with self._lock:
            self._loaded = False
            self._pm = None

    # ------------------------------------------------------------- querying
    def plugin_records(self) -> list[PluginRecord]:
        self._ensure_loaded()
        return list(self._records.values())

    def broken(self) -> list[PluginRecord]:
        return [r for r in self.plugin_records() if r.status in ("broken", "skipped")]

    def specs(self) -> list[AttentionSpec]:
        """Every registered spec (plugins, then in-process), in registration order."""
        self._ensure_loaded()
        out = [s for specs in self._plugin_specs.values() for s in specs]
        return out + list(self._local)

    def resolve(self, name: str) -> AttentionSpec:
        """The spec for ``name``, an alias, ``family/name`` or ``distribution:name``.

        Raises:
            UnknownAttentionError: no such name (suggests close ones).
            AmbiguousNameError: two distributions provide it.
        """
        return _lookup(self.specs(), name, kind="attention", records=self.plugin_records())

    def spec_for_class(self, cls: type) -> AttentionSpec | None:
        """The spec whose factory is ``cls`` (a module built without :meth:`build`); None when
        there is none, or when several names register the class (then only ``build`` can tell)."""
        path = f"{cls.__module__}:{cls.__qualname__}"
        found = [s for s in self.specs() if s.factory is cls or s.factory == path]
        return found[0] if len(found) == 1 else None

    # ---------------------------------------------------------------- blocks
    def blocks(self) -> list[BlockSpec]:
        """Every registered block spec (plugins, then in-process)."""
        self._ensure_loaded()
        return [b for bs in self._plugin_blocks.values() for b in bs] + list(self._local_blocks)

    def resolve_block(self, name: str) -> BlockSpec:
        """The block spec for ``name``, an alias, ``family/name`` or ``distribution:name``.

        Raises:
            UnknownAttentionError: no such block (suggests close names).
            AmbiguousNameError: two distributions provide it.
        """
        return _lookup(self.blocks(), name, kind="block", records=self.plugin_records())

    def build_block(self, name: str, *, dim: int, num_heads: int, attention: Any = "softmax",
                    **options: Any) -> Any:
        """Build the block registered as ``name``: ``factory(dim=, num_heads=, attention=, **options)``.

        Raises:
            UnknownAttentionError, AmbiguousNameError: see :meth:`resolve_block`.
            InvalidInputError: an option the block does not take, or of the wrong type.
            PluginLoadError: the block's module cannot be imported, or the factory returned no Block.
        """
        spec = self.resolve_block(name)
        factory = _load(spec)
        opts = {**spec.defaults, **options}
        check_options(f"build_block({spec.name!r})", _options_of(spec), opts, takes_extra=_takes_extra(factory))
        obj = factory(dim=dim, num_heads=num_heads, attention=attention, **opts)
        if not isinstance(obj, Block):
            raise PluginLoadError(
                spec.plugin or spec.name,
                f"block factory {spec.factory_path} returned {type(obj).__name__}, not an attnkit.Block")
        obj.block_spec = spec
        obj.build_options = {"dim": dim, "num_heads": num_heads, "attention": attention, **opts}
        return obj

    def register_block(self, spec: BlockSpec) -> BlockSpec:
        """Register a block in this process (notebooks, tests)."""
        if not isinstance(spec, BlockSpec):
            raise InvalidInputError(f"register_block: expected an attnkit.BlockSpec, got {type(spec).__name__}")
        spec = dataclasses.replace(spec, plugin=LOCAL, distribution=LOCAL, version="")
        with self._lock:
            if any({o.name, *o.aliases} & {spec.name, *spec.aliases} for o in self._local_blocks):
                raise InvalidInputError(f"register_block: {spec.name!r} is already registered in this process")
            self._local_blocks.append(spec)
        return spec

    def unregister_block(self, spec_or_name: BlockSpec | str) -> None:
        with self._lock:
            before = len(self._local_blocks)
            name = spec_or_name.name if isinstance(spec_or_name, BlockSpec) else spec_or_name
            self._local_blocks = [b for b in self._local_blocks if b.name != name]
            if len(self._local_blocks) == before:
                raise InvalidInputError(f"unregister_block: {spec_or_name!r} is not registered in this process")

    @contextlib.contextmanager
    def registered_block(self, spec: BlockSpec) -> Iterator[BlockSpec]:
        """Register a block for a ``with`` block; always unregisters."""
        spec = self.register_block(spec)
        try:
            yield spec
        finally:
            with contextlib.suppress(InvalidInputError):
                self.unregister_block(spec)

    def available(self, **filters: Any) -> list[AttentionSpec]:
        """Specs whose capabilities match every filter.

        Filters: any :class:`Capabilities` field (bools compare equal;
        ``streaming=True`` means any streaming, a string compares equal;
        ``dtypes=``/``backends=`` test membership), and ``family``, ``exact``,
        ``distribution``, ``plugin``.
        """
        valid = _CAP_FIELDS | {"family", "exact", "distribution", "plugin"}
        unknown = set(filters) - valid
        if unknown:
            raise InvalidInputError(
                f"available: unknown filter(s) {sorted(unknown)}; valid filters: {sorted(valid)}"
            )
        out = []
        for s in self.specs():
            if all(_matches(s, k, v) for k, v in filters.items()):
                out.append(s)
        return out

    # ------------------------------------------------------------- building
    def build(self, name: str, **options: Any) -> Any:
        """Construct the implementation registered as ``name`` with ``options``.

        Raises:
            UnknownAttentionError, AmbiguousNameError: see :meth:`resolve`.
            InvalidInputError: an option the implementation does not take.
            PluginLoadError: the implementation's module cannot be imported.
        """
        spec = self.resolve(name)
        factory = _load(spec)
        opts = {**spec.defaults, **options}
        check_options(f"build({spec.name!r})", _options_of(spec), opts, takes_extra=_takes_extra(factory))
        if "backend" in opts:
            try:
                _backends.check_offered(spec.name, spec.capabilities.backends, opts["backend"])
            except InvalidInputError as exc:
                raise InvalidInputError(f"build({spec.name!r}): option {exc}") from None
        obj = factory(**opts)
        if not isinstance(obj, Attention):
            raise PluginLoadError(
                spec.plugin or spec.name,
                f"factory {spec.factory_path} returned {type(obj).__name__}, not an attnkit.Attention",
            )
        obj.spec = spec
        obj.build_options = dict(opts)      # what reset_parameters() rebuilds with
        return obj

    def build_with_hints(self, name: str, hints: dict[str, Any], **options: Any) -> Any:
        """Build ``name`` with ``options``, plus each hint the factory takes and ``options`` leaves unset.

        Layers and tools know the shape (``num_heads``, ``head_dim``) but not whether
        an implementation wants it; hints go only where the factory's options name
        them (or to every factory whose options cannot be read, so that
        :meth:`build` reports why).
        """
        spec = self.resolve(name)
        try:
            takes = {o.name for o in spec.resolved_options()}
        except Exception:  # noqa: BLE001 - build reports import failures with their reason
            takes = set()
        extra = {k: v for k, v in hints.items() if (not takes or k in takes) and k not in options}
        return self.build(name, **extra, **options)

    # ------------------------------------------------------- in-process use
    def register(self, spec_or_class: Any, **fields: Any) -> AttentionSpec:
        """Register an implementation in this process (notebooks, tests)."""
        spec = make_spec(spec_or_class, fields)
        spec = dataclasses.replace(spec, plugin=LOCAL, distribution=LOCAL, version="")
        with self._lock:
            for other in self._local:
                if {other.name, *other.aliases} & {spec.name, *spec.aliases}:
                    raise InvalidInputError(
                        f"register: {spec.name!r} is already registered in this process; "
                        "unregister it first or use attnkit.registered(...) as a context manager"
                    )
            self._local.append(spec)
        _backends.declare_backends(spec.capabilities.backends)
        return spec

    def unregister(self, spec_or_name: AttentionSpec | str) -> None:
        """Remove an in-process registration."""
        with self._lock:
            before = len(self._local)
            if isinstance(spec_or_name, AttentionSpec):
                self._local = [s for s in self._local if s is not spec_or_name and s != spec_or_name]
            else:
                self._local = [s for s in self._local if s.name != spec_or_name]
            if len(self._local) == before:
                raise InvalidInputError(f"unregister: {spec_or_name!r} is not registered in this process")

    @contextlib.contextmanager
    def registered(self, spec_or_class: Any, **fields: Any) -> Iterator[AttentionSpec]:
        """Register for the duration of a ``with`` block; always unregisters."""
        spec = self.register(spec_or_class, **fields)
        try:
            yield spec
        finally:
            with contextlib.suppress(InvalidInputError):
                self.unregister(spec)

    @contextlib.contextmanager
    def plugin(self, obj: Any, *, name: str = LOCAL + "-plugin", distribution: str = LOCAL,
               version: str = "") -> Iterator[PluginRecord]:
        """Load a plugin object (module or instance with hook implementations) for a ``with`` block."""
        self._ensure_loaded()
        if name in self._records:
            raise InvalidInputError(f"plugin: a plugin named {name!r} is already loaded")
        rec = PluginRecord(name, distribution, version, getattr(obj, "__name__", type(obj).__name__), "loaded")
        reason = check_api_version(obj, name)
        with self._lock:
            if reason is not None:
                rec.status, rec.error = "skipped", reason
                self._records[name] = rec
            else:
                self._add(obj, rec)
        try:
            yield rec
        finally:
            with self._lock:
                self._records.pop(name, None)
                self._plugin_specs.pop(name, None)
                self._plugin_blocks.pop(name, None)
                if self._pm is not None and self._pm.has_plugin(name):
                    self._pm.unregister(name=name)

    # ------------------------------------------------------------- commands
    def call_command_hooks(self, cli: Any) -> None:
        """Let every loaded plugin add CLI commands; a failing plugin is marked broken."""
        self._ensure_loaded()
        assert self._pm is not None
        for impl in self._pm.hook.attnkit_register_commands.get_hookimpls():
            rec = self._records.get(impl.plugin_name)
            try:
                impl.function(**{a: cli for a in impl.argnames})
            except (PluginLoadError, KeyboardInterrupt):
                raise
            except BaseException as exc:  # noqa: BLE001 - isolation, sys.exit() included
                if rec is not None:
                    fail(rec, f"attnkit_register_commands raised {type(exc).__name__}: {exc}")


def _matches(spec: AttentionSpec, key: str, want: Any) -> bool:
    if key in ("family", "exact", "distribution", "plugin"):
        return getattr(spec, key) == want
    have = getattr(spec.capabilities, key)
    if key == "streaming":
        if want is True:
            return have is not None
        if want is False or want is None:
            return have is None
        return have == want
    if isinstance(have, tuple):
        return want in have
    return have == want


def _lookup(specs: list[Any], name: str, *, kind: str, records: list[PluginRecord]) -> Any:
    """Find ``name`` (alias, ``family/name``, ``distribution:name``) among ``specs``."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"name: expected a registered {kind} name (str), got {name!r}")
    key = name.strip().lower()
    qual_dist = qual_family = None
    if ":" in key:
        qual_dist, _, key = key.partition(":")
    elif "/" in key:
        qual_family, _, key = key.partition("/")
    cands = [s for s in specs if key == s.name or key in s.aliases]
    if qual_dist is not None:
        want = _normalise_dist(qual_dist)
        cands = [s for s in cands if want in (_normalise_dist(s.distribution), _normalise_dist(s.plugin))]
    if qual_family is not None:
        cands = [s for s in cands if s.family == qual_family]
    if not cands:
        known = {n for s in specs for n in (s.name, *s.aliases)}
        broken = [r.name for r in records if r.status in ("broken", "skipped")]
        not_loaded = {r.distribution: f"{r.status}: {r.error}" for r in records
                      if r.status != "loaded" and r.distribution}
        raise UnknownAttentionError(name, known, broken=broken, kind=kind, not_loaded=not_loaded)
    if len(cands) > 1:
        raise AmbiguousNameError(key, [(s.distribution or s.plugin, s.family) for s in cands])
    return cands[0]


def _normalise_dist(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): runs of ``-``, ``_`` and ``.`` are one ``-``."""
    return re.sub(r"[-_.]+", "-", (name or "").strip()).lower()


def _load(spec: Any) -> Callable[..., Any]:
    try:
        return spec.load_factory()
    except Exception as exc:
        raise PluginLoadError(
            spec.plugin or spec.name,
            f"cannot import the factory {spec.factory_path} of {spec.name!r}: {type(exc).__name__}: {exc}",
        ) from exc


def _options_of(spec: Any) -> tuple[Any, ...]:
    try:
        return spec.resolved_options()
    except PluginLoadError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise PluginLoadError(spec.plugin or spec.name,
                              f"cannot read the options of {spec.name!r} ({spec.factory_path}): {exc}") from exc


def _takes_extra(factory: Any) -> bool:
    target = factory.__init__ if inspect.isclass(factory) else factory
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return True
    return any(p.kind == p.VAR_KEYWORD for p in params.values())


def _hook_names() -> list[str]:
    return sorted(n for n in dir(hookspecs) if n.startswith("attnkit_"))


def _unknown_hooks(pm: pluggy.PluginManager, obj: Any) -> list[str]:
    """Hook implementations of ``obj`` that match no hook spec (misspellings).

    What pluggy's ``check_pending()`` checks, for one plugin: an implementation
    marked ``optionalhook=True`` may name a hook this attnkit does not have;
    ``specname=`` is honoured.
    """
    out = []
    for caller in pm.get_hookcallers(obj) or []:
        if caller.has_spec():
            continue
        if any(impl.plugin is obj and not impl.optionalhook for impl in caller.get_hookimpls()):
            out.append(caller.name)
    return sorted(out)


def _unknown_hooks_message(unknown: list[str]) -> str:
    import difflib

    valid = _hook_names()
    hints = []
    for n in unknown:
        close = difflib.get_close_matches(n, valid, n=1, cutoff=0.6)
        hints.append(f"{n!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"unknown hook(s) {', '.join(hints)}: no such hook in this attnkit, so nothing of the plugin was "
            f"registered; the hooks are {valid} (rename the function, or mark it "
            f"@attnkit.hookimpl(optionalhook=True) if it targets a newer attnkit)")


_DEFAULT = Registry()


def default_registry() -> Registry:
    """The process-wide registry used by :func:`attnkit.build` and friends."""
    return _DEFAULT


set_registry_provider(default_registry)
