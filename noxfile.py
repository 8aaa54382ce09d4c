"""Sessions for attnkit: lint, the test suite, and its parts one at a time.

``nox`` with no arguments runs what CI needs: ``lint`` and ``suite``. ``suite`` is every test in ONE venv, step by
step: the core alone; the lab beside it (it must work with softmax alone); each plugin with only the core (the venv
is put back to the core's distributions after each, so an undeclared dependency still fails); then everything
installed (integration, the third-party fixture, the triton kernels in the interpreter, attnkit-transformers).
A failed step does not stop the next ones; the session fails at the end naming every failed step.
One venv instead of seven saves creating it and installing torch six more times (about 25-50 s each on a 2-core
machine). ``tests``, ``plugin``, ``integration``, ``lab``, ``kernels`` and ``transformers`` run those parts alone,
each in a venv of its own; ``demo`` and ``pictures`` are not tests.
Every install goes through ``constraints.txt`` (the local CPU torch wheel).
Sessions run on the interpreter nox runs under; no version list to miss.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
CORE = str(ROOT / "packages" / "attnkit")
#: the test runner's process pool (see :data:`WORKERS`); pinned in constraints.txt like every install
XDIST = ("pytest-xdist",)
LAB = str(ROOT / "packages" / "attnkit-lab")
FIXTURES = ROOT / "integration_tests" / "fixtures"


def _pyproject(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip's vendored copy of the same parser
        from pip._vendor import tomli as tomllib
    return tomllib.loads((path / "pyproject.toml").read_text(encoding="utf-8"))


def _siblings_declared(path: Path) -> list[str]:
    return list(_pyproject(path).get("tool", {}).get("attnkit", {}).get("nox", {}).get("siblings", []))


def _plugin_order() -> list[str]:
    """The plugins of ``plugins/``, each after the siblings it names (``[tool.attnkit.nox] siblings``), else by
    name: a plugin's sibling run then finds the sibling's numba kernels compiled in the numba cache beside its
    sources (the editable installs share it), instead of compiling them again."""
    names = sorted(p.name for p in (ROOT / "plugins").glob("*") if (p / "pyproject.toml").exists())
    order: list[str] = []

    def visit(name: str, seen: tuple[str, ...]) -> None:
        if name in order or name in seen or name not in names:
            return
        for s in _siblings_declared(ROOT / "plugins" / name):
            visit(s, (*seen, name))
        order.append(name)

    for n in names:
        visit(n, ())
    return order


PLUGINS = _plugin_order()

nox.options.sessions = ["lint", "suite"]
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = False

#: Python writes no bytecode where ``PYTHONDONTWRITEBYTECODE`` is set (this project's machines set it), and the
#: installs below skip pip's byte-compiling (``--no-compile``): every process the tests start (pytest-xdist
#: workers, the CLI, training and DDP ranks, the third-party checks) then compiled torch's, numba's and our modules
#: from source again, 7-9 s per ``import torch, numba, attnkit, attnkit_sparse`` against 2.7-2.9 s from bytecode
#: (session 32, 2-core VM). The sessions let Python write the bytecode of what they import, once, into the venv.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def install(session: nox.Session, *args: str) -> None:
    """pip install through the constraints. ``--no-compile``: pip byte-compiles every installed module (torch's
    thousands) by default, half of each session's ~50 s install on the 2-core CI machine; Python compiles the
    modules a session imports when it first imports them and keeps the bytecode (see the note on
    ``PYTHONDONTWRITEBYTECODE`` above)."""
    session.install("--no-compile", *CONSTRAINTS, *args)


#: pytest-xdist workers for the sessions that can share the machine: the plugins' first runs are mostly numba
#: compiling its kernels, one kernel at a time on one core, and the triton interpreter is plain Python, so two
#: processes finish a 2-core CI machine's plugin sessions in about two thirds of the time (kernelized: 5.1 ->
#: 3.4 min). ``loadfile`` keeps a test module on one worker, so a module's kernels compile once, not in both.
#: ``ATTNKIT_TEST_WORKERS=0`` runs every session in one process.
WORKERS = int(os.environ.get("ATTNKIT_TEST_WORKERS", min(4, os.cpu_count() or 1)))


def pytest(session: nox.Session, *args: str, parallel: bool = False, env: dict[str, str] | None = None,
           dist: str = "loadfile") -> None:
    """Run pytest; 'no tests collected' (exit 5) counts as a failure.

    ``parallel``: spread the tests over :data:`WORKERS` processes (pytest-xdist, ``--dist`` ``dist``: ``loadfile``
    keeps a module on one worker, ``loadscope`` a class). Tests that change the venv (integration's third-party
    tests install and remove distributions) stay serial. ``env``: variables for this run only (on top of the
    session's).
    """
    spread = ("-n", str(WORKERS), "--dist", dist) if parallel and WORKERS > 1 else ()
    # the ten slowest tests of each run in the log: where a CI run's time went, without a second run
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--durations=10", *spread, *args, *session.posargs,
                env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    install(session, "ruff")
    session.run("ruff", "check", str(ROOT))


@nox.session
def tests(session: nox.Session) -> None:
    """The core package alone, then the lab beside it (still without a plugin: it must work with softmax alone)."""
    install(session, "-e", f"{CORE}[testing]", *XDIST)
    _core_tests(session)
    if (ROOT / "packages" / "attnkit-lab" / "pyproject.toml").exists():
        _lab_tests(session)


def _core_tests(session: nox.Session) -> None:
    pytest(session, str(ROOT / "packages" / "attnkit" / "tests"), parallel=True)


@nox.session
def lab(session: nox.Session) -> None:
    """The lab with only the core (it must work with softmax alone)."""
    if not (ROOT / "packages" / "attnkit-lab" / "pyproject.toml").exists():
        session.skip("packages/attnkit-lab does not exist yet")
    install(session, "-e", f"{CORE}[testing]", *XDIST)
    _lab_tests(session)


def _lab_tests(session: nox.Session) -> None:
    install(session, "-e", LAB)
    pytest(session, str(ROOT / "packages" / "attnkit-lab" / "tests"), parallel=True)


@nox.session
@nox.parametrize("name", PLUGINS or ["none"])
def plugin(session: nox.Session, name: str) -> None:
    """One plugin in its own venv with only the core: catches undeclared dependencies."""
    if name == "none":
        session.skip("no plugin in plugins/ yet")
    install(session, "-e", f"{CORE}[testing]", *XDIST)
    _plugin_tests(session, name)


def _plugin_tests(session: nox.Session, name: str) -> None:
    """Install plugin ``name`` beside what the venv has (the core) and run its tests with strict plugin loading;
    then, if it names siblings, install them and run its tests marked ``siblings`` again."""
    path = ROOT / "plugins" / name
    install(session, "-e", str(path))
    strict = {"ATTNKIT_STRICT_PLUGINS": "1"}
    dist = _dist(path)
    pytest(session, str(path / "tests"), "-m", "not triton", parallel=True, env=strict, dist=dist)
    siblings = nox_siblings(path)
    if siblings:  # the tests marked `siblings` again, with the sibling plugins whose optional paths they use
        install(session, *[a for s in siblings for a in ("-e", str(ROOT / "plugins" / s))])
        pytest(session, str(path / "tests"), "-m", "siblings and not triton", parallel=True, env=strict, dist=dist)


def _dist(path: Path) -> str:
    """How a plugin's tests spread over the workers: a plugin that depends on numba keeps each test module on one
    worker (``loadfile``), so the kernels a module's tests share compile once, not in two workers at the same
    moment (numba writes its cache only when a build ends); the others spread by class (``loadscope``), so one
    large conformance module does not run on one worker alone (attnkit-lowrank: 61 s against 92 s, session 33)."""
    deps = _pyproject(path).get("project", {}).get("dependencies", [])
    return "loadfile" if any(re.match(r"numba\b", d.strip()) for d in deps) else "loadscope"


def nox_siblings(path: Path) -> list[str]:
    """``[tool.attnkit.nox] siblings`` of a plugin's pyproject: plugins of this repository it can use.

    A plugin must pass with only the core installed; its optional paths through a sibling plugin
    (an extra, not a dependency: the siblings are not on the package index) are tested in a second run of
    the tests it marks ``siblings`` (a marker its pytest configuration declares).
    """
    siblings = _siblings_declared(path)
    missing = [s for s in siblings if not (ROOT / "plugins" / s / "pyproject.toml").exists()]
    if missing:
        raise ValueError(f"{path.name}: [tool.attnkit.nox] siblings names {missing}, not plugins of this repository")
    return list(siblings)


@nox.session
def integration(session: nox.Session) -> None:
    """Everything installed, strict plugin loading, the third-party fixture installed with pip; then, in the same
    venv, the triton kernels in the interpreter (:func:`kernels`) and attnkit-transformers (:func:`transformers`)."""
    _integration_tests(session)


def _integration_tests(session: nox.Session) -> None:
    pkgs = [f"{CORE}[testing]"] + ([LAB] if Path(LAB, "pyproject.toml").exists() else [])
    pkgs += [str(ROOT / "plugins" / p) for p in PLUGINS]
    install(session, *[a for p in pkgs for a in ("-e", p)], *XDIST)
    install(session, str(FIXTURES / "attnkit-thirdparty"))
    env = {"ATTNKIT_STRICT_PLUGINS": "1", "ATTNKIT_FIXTURES": str(FIXTURES), "ATTNKIT_CONSTRAINTS": CONSTRAINTS[1]}
    session.run("attnkit", "list", env=env)
    tests_dir = ROOT / "integration_tests"
    # the third-party tests install and remove distributions in this venv: alone first, then the rest spread out
    pytest(session, str(tests_dir / "test_thirdparty_plugin.py"), env=env)
    pytest(session, str(tests_dir), "--ignore", str(tests_dir / "test_thirdparty_plugin.py"), parallel=True, env=env)
    # what the kernel and transformers tests see: this repository's packages, not the test fixture's plugin
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "attnkit-thirdparty")
    _kernel_tests(session)
    _transformers_tests(session)


@nox.session
def suite(session: nox.Session) -> None:
    """Every test in one venv (what CI runs after ``lint``; the module docstring says why): the core, the lab beside
    it, each plugin with only the core, then integration, the triton kernels and attnkit-transformers.

    Between the steps that must see only the core, the venv is put back to the distributions it had after the
    core's install (:func:`_back_to`), but for what the next step declares (:func:`_dependencies`). A failed step
    is reported and the next one runs; the session fails at the end with the list.
    """
    install(session, "-e", f"{CORE}[testing]", *XDIST)
    core = _installed(session)
    steps: list[tuple[str, Callable[[], None]]] = [("core", lambda: _core_tests(session))]
    needs: dict[str, list[Path]] = {"core": []}  # what each step installs (whose dependencies it declares)
    if Path(LAB, "pyproject.toml").exists():
        steps.append(("lab", lambda: _lab_tests(session)))
        needs["lab"] = [Path(LAB)]
    steps += [(name, lambda name=name: _plugin_tests(session, name)) for name in PLUGINS]
    needs.update({name: [ROOT / "plugins" / name] for name in PLUGINS})
    steps.append(("integration", lambda: _integration_tests(session)))
    needs["integration"] = [p for paths in needs.values() for p in paths]
    failed = []
    for i, (name, step) in enumerate(steps):
        session.log(f"suite: {name}")
        try:
            step()
        except CommandFailed:
            failed.append(name)
        finally:
            if name != "integration":
                _back_to(session, core, keep=_dependencies(session, needs[steps[i + 1][0]]))
    if failed:
        session.error(f"suite: {len(failed)} of {len(steps)} steps failed: {', '.join(failed)}")


def _installed(session: nox.Session) -> dict[str, str]:
    """``{distribution name (lower case): version}`` of the session's venv."""
    out = session.run("python", "-c", (
        "import json, importlib.metadata as m; "
        "print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"),
        silent=True, log=False, stderr=None)
    return json.loads(str(out).strip().splitlines()[-1])


def _back_to(session: nox.Session, core: dict[str, str], keep: frozenset[str] = frozenset()) -> None:
    """Uninstall every distribution the venv did not have in ``core``, except those in ``keep`` (normalised
    names: the dependencies the next step declares, which its install would bring back at the same pinned
    versions); fail if one of ``core``'s was removed or changed version (a step's install must not change what
    the next step sees)."""
    now = _installed(session)
    extra = sorted(n for n in set(now) - set(core) if _norm(n) not in keep)
    if extra:
        session.run("python", "-m", "pip", "uninstall", "-q", "-y", *extra)
        now = _installed(session)
    changed = sorted(n for n in core if now.get(n) != core[n])
    if changed:
        session.error(f"the venv no longer has the core's distributions as installed: {changed} "
                      f"(expected {[f'{n}=={core[n]}' for n in changed]}, found {[now.get(n) for n in changed]})")


def _norm(name: str) -> str:
    """A distribution name in its normalised form (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: run in the venv: the installed distributions that the requirements in argv[1] (a JSON list) pull in,
#: directly or through the requirements of what they pull in (markers evaluated without extras)
_CLOSURE = """
import importlib.metadata as m, json, re, sys
from pip._vendor.packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
todo, seen = [norm(Requirement(r).name) for r in json.loads(sys.argv[1])], set()
while todo:
    n = todo.pop()
    if n in seen:
        continue
    seen.add(n)
    try:
        reqs = m.distribution(n).requires or []
    except m.PackageNotFoundError:
        continue
    for r in map(Requirement, reqs):
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(norm(r.name))
print(json.dumps(sorted(seen)))
"""


def _dependencies(session: nox.Session, paths: list[Path]) -> frozenset[str]:
    """The installed distributions that the packages at ``paths`` declare as dependencies, with theirs; never
    this repository's own packages (each step installs those itself, editable). Between two plugin steps that
    both need numba, numba, llvmlite and numpy then stay instead of being uninstalled and installed again,
    and a plugin that uses a package it does not declare still finds it missing."""
    reqs = [r for p in paths for r in _pyproject(p).get("project", {}).get("dependencies", [])]
    if not reqs:
        return frozenset()
    out = session.run("python", "-c", _CLOSURE, json.dumps(reqs), silent=True, log=False, stderr=None)
    names = json.loads(str(out).strip().splitlines()[-1])
    return frozenset(n for n in names if not n.startswith("attnkit"))


def _with_kernels() -> list[str]:
    """The plugins with triton kernel tests: a test module of theirs marks tests with ``pytest.mark.triton``."""
    return [
        p for p in PLUGINS
        if any("mark.triton" in f.read_text(encoding="utf-8") for f in (ROOT / "plugins" / p / "tests").glob("*.py"))
    ]


@nox.session
def kernels(session: nox.Session) -> None:
    """Triton kernels in the interpreter (TRITON_INTERPRET=1) on CPU tensors, plugin by plugin (CI runs them in
    ``integration``)."""
    if not _with_kernels():
        session.skip("no plugin ships triton kernel tests yet")
    install(session, "-e", f"{CORE}[testing]", *[a for p in _with_kernels() for a in ("-e", str(ROOT / "plugins" / p))],
            *XDIST)
    _kernel_tests(session)


def _kernel_tests(session: nox.Session) -> None:
    """Install triton and run each kernel plugin's ``triton`` tests in its own pytest call (test modules of the
    same name in two plugins never clash)."""
    install(session, "triton")
    for p in _with_kernels():
        pytest(session, str(ROOT / "plugins" / p / "tests"), "-m", "triton", parallel=True,
               env={"TRITON_INTERPRET": "1"})


@nox.session
def transformers(session: nox.Session) -> None:
    """attnkit-transformers with transformers from the index (pinned) and every plugin: tiny models, no downloads
    (CI runs them in ``integration``)."""
    install(session, "-e", f"{CORE}[testing]", *[a for p in PLUGINS for a in ("-e", str(ROOT / "plugins" / p))],
            *XDIST)
    _transformers_tests(session)


def _transformers_tests(session: nox.Session) -> None:
    path = ROOT / "packages" / "attnkit-transformers"
    install(session, "-e", str(path))
    pytest(session, str(path / "tests"),
           env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"})


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the lab's quick demo (bench, error, train) with every package installed."""
    pkgs = [CORE] + [str(ROOT / "plugins" / p) for p in PLUGINS]
    if Path(LAB, "pyproject.toml").exists():
        pkgs.append(LAB)
    install(session, *[a for p in pkgs for a in ("-e", p)])
    # numba's OpenMP threads spin between parallel regions and slow torch's threads (docs/benchmarks.md);
    # it must be set before torch starts, so the session sets it rather than the lab
    session.env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    session.run("attnkit", "list")
    if Path(LAB, "pyproject.toml").exists():
        session.run("attnkit", "demo", "--preset", "quick", *session.posargs)
    else:  # before the lab exists: a short build-and-run example
        session.run("python", "-c", (
            "import torch, attnkit; a = attnkit.build('softmax'); q = torch.randn(1, 2, 8, 4); "
            "print('softmax', tuple(a(q, q, q, causal=True).shape))"))


@nox.session
def pictures(session: nox.Session) -> None:
    """Redraw docs/images/sparse/<pattern>.png from the code (``attnkit describe NAME --plot``); not in CI."""
    install(session, "-e", CORE, "-e", str(ROOT / "plugins" / "attnkit-sparse"), "matplotlib")
    session.run("python", "-m", "attnkit_sparse.pictures", str(ROOT / "docs" / "images" / "sparse"))
