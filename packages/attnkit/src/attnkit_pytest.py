"""The conformance kit as a pytest plugin: ``pytest --attnkit-check NAME``.

Registered through the ``pytest11`` entry point of the ``attnkit``
distribution, so every pytest run in an environment with attnkit loads this
module. It must stay cheap: it is a top-level module of the distribution (not
inside the ``attnkit`` package, whose ``__init__`` imports torch), and it
imports neither torch nor attnkit, nor loads any attnkit plugin or registry,
until ``--attnkit-check`` is given. Without the
option it adds no test and changes nothing.

With ``--attnkit-check NAME`` (repeatable; ``NAME@key=value,key=value`` adds
build options, parsed by the option's type):

* every check of :data:`attnkit.testing.CHECKS` runs on every NAME, as
  parametrised items ``test_attnkit_conformance[NAME-check]`` (skipped checks
  carry their reason, as with :class:`attnkit.testing.AttentionConformance`);
* tests that request the fixtures ``attnkit_name``, ``attnkit_mechanism`` (the
  built module, in eval mode, built under seed 0) or ``attnkit_build`` (a
  factory ``attnkit_build(**options)``) run once per NAME.

An unknown NAME or option is a usage error (exit status 4) naming it. Put the
option in your configuration to make it the default::

    [tool.pytest.ini_options]
    addopts = "--attnkit-check my-attn"
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_KEY = pytest.StashKey[list]()


def _kit_tests() -> Path:
    """``attnkit/testing/kit_tests.py``, found without importing attnkit (finding a spec runs no code)."""
    spec = importlib.util.find_spec("attnkit")
    if spec is None or not spec.submodule_search_locations:
        raise pytest.UsageError("--attnkit-check: the attnkit package cannot be found in this environment")
    return Path(next(iter(spec.submodule_search_locations))) / "testing" / "kit_tests.py"



_FIXTURES = ("attnkit_name", "attnkit_mechanism", "attnkit_build")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnkit", "attnkit conformance kit")
    group.addoption(
        "--attnkit-check", action="append", default=[], metavar="NAME", dest="attnkit_check",
        help="run the attnkit conformance kit on the registered attention NAME (repeatable; "
             "NAME@key=value,... adds build options); tests using the attnkit_mechanism fixture run per NAME")


def _parse(entry: str) -> tuple[str, dict[str, Any]]:
    """``"name@k=v,k2=v2"`` -> ``(name, {k: v, ...})`` with values parsed by the options' types."""
    import attnkit
    from attnkit.options import check_options, parse_text

    name, _, rest = entry.partition("@")
    name = name.strip()
    if not name:
        raise pytest.UsageError(f"--attnkit-check {entry!r}: expected NAME or NAME@key=value,...")
    try:
        spec = attnkit.get_spec(name)
    except (KeyError, LookupError) as exc:
        raise pytest.UsageError(f"--attnkit-check {entry!r}: {exc.args[0] if exc.args else exc}") from None
    schema = {o.name: o for o in spec.resolved_options()}
    options: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise pytest.UsageError(f"--attnkit-check {entry!r}: option {item!r} must be key=value")
        if key not in schema:
            raise pytest.UsageError(
                f"--attnkit-check {entry!r}: {spec.name!r} has no option {key!r}; it takes {', '.join(schema)}")
        try:
            options[key] = parse_text(schema[key], text)
        except ValueError as exc:
            raise pytest.UsageError(f"--attnkit-check {entry!r}: option {key}: {exc}") from None
    try:
        check_options(f"--attnkit-check {entry!r}", schema.values(), options)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return name, options


def pytest_configure(config: pytest.Config) -> None:
    entries = config.getoption("attnkit_check", default=None) or []
    if not entries:
        return
    config.stash[_KEY] = [_parse(e) for e in entries]
    config.addinivalue_line("markers", "attnkit_conformance: a check of the attnkit conformance kit")
    # the kit's items live in one module; collect it beside whatever else was asked for
    config.args.append(str(_kit_tests()))


def _label(name: str, options: dict[str, Any]) -> str:
    return name + "".join(f",{k}={v}" for k, v in options.items()) if options else name


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    targets = metafunc.config.stash.get(_KEY, None)
    if not targets:
        return
    if metafunc.definition.name == "test_attnkit_conformance" and Path(str(metafunc.definition.path)) == _kit_tests():
        from attnkit.testing.checks import CHECKS

        cases = [(name, opts, check) for name, opts in targets for check in CHECKS]
        metafunc.parametrize("attnkit_case", cases,
                             ids=[f"{_label(n, o)}-{c}" for n, o, c in cases])
        return
    if any(f in metafunc.fixturenames for f in _FIXTURES):
        metafunc.parametrize("attnkit_target", targets, ids=[_label(n, o) for n, o in targets], scope="module")


@pytest.fixture(scope="module")
def attnkit_target(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of one ``--attnkit-check`` entry (parametrised by the option)."""
    raise pytest.UsageError(
        f"{request.node.nodeid} uses the attnkit fixtures, which need --attnkit-check NAME "
        "(e.g. addopts = \"--attnkit-check my-attn\" in your pytest configuration)")


@pytest.fixture(scope="module")
def attnkit_name(attnkit_target: tuple[str, dict[str, Any]]) -> str:
    """The registered name under test (one per ``--attnkit-check NAME``)."""
    return attnkit_target[0]


@pytest.fixture
def attnkit_build(attnkit_target: tuple[str, dict[str, Any]]) -> Any:
    """A factory: ``attnkit_build(**options)`` builds the mechanism under test (the option's
    options, then these) under ``torch.manual_seed(seed)`` (``seed=0`` by default), in eval mode."""
    import torch

    import attnkit

    name, base = attnkit_target

    def build(*, seed: int = 0, **options: Any) -> attnkit.Attention:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return attnkit.build(name, **{**base, **options}).eval()

    return build


@pytest.fixture
def attnkit_mechanism(attnkit_build: Any) -> Any:
    """The mechanism under test, built with the option's options under seed 0, in eval mode."""
    return attnkit_build()
