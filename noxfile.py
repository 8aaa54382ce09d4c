"""Sessions for attnkit: lint, per-package tests, integration, kernels, transformers, demo.

``nox`` with no arguments runs what CI needs: ``lint``, ``tests`` (the core, then the lab beside it),
``plugin`` (each plugin alone) and ``integration`` (everything installed, then the triton kernels in the
interpreter and attnkit-transformers in the same venv). ``lab``, ``kernels`` and ``transformers`` run those
parts alone; ``demo`` and ``pictures`` are not tests. Fewer venvs is CI time: each one installs torch again
(about 30-60 s on the 2-core CI machine).
Every install goes through ``constraints.txt`` (the local CPU torch wheel).
Sessions run on the interpreter nox runs under; no version list to miss.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

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

nox.options.sessions = ["lint", "tests", "plugin", "integration"]
nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = False


def install(session: nox.Session, *args: str) -> None:
    """pip install through the constraints. ``--no-compile``: pip byte-compiles every installed module (torch's
    thousands) by default, half of each session's ~50 s install on the 2-core CI machine; Python compiles the
    modules a session imports when it imports them."""
    session.install("--no-compile", *CONSTRAINTS, *args)


#: pytest-xdist workers for the sessions that can share the machine: the plugins' first runs are mostly numba
#: compiling its kernels, one kernel at a time on one core, and the triton interpreter is plain Python, so two
#: processes finish a 2-core CI machine's plugin sessions in about two thirds of the time (kernelized: 5.1 ->
#: 3.4 min). ``loadfile`` keeps a test module on one worker, so a module's kernels compile once, not in both.
#: ``ATTNKIT_TEST_WORKERS=0`` runs every session in one process.
WORKERS = int(os.environ.get("ATTNKIT_TEST_WORKERS", min(4, os.cpu_count() or 1)))


def pytest(session: nox.Session, *args: str, parallel: bool = False, env: dict[str, str] | None = None) -> None:
    """Run pytest; 'no tests collected' (exit 5) counts as a failure.

    ``parallel``: spread the test modules over :data:`WORKERS` processes (pytest-xdist, ``--dist loadfile``).
    Tests that change the venv (integration's third-party tests install and remove distributions) stay serial.
    ``env``: variables for this run only (on top of the session's).
    """
    spread = ("-n", str(WORKERS), "--dist", "loadfile") if parallel and WORKERS > 1 else ()
    session.run("pytest", "-q", "-p", "no:cacheprovider", *spread, *args, *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    install(session, "ruff")
    session.run("ruff", "check", str(ROOT))


@nox.session
def tests(session: nox.Session) -> None:
    """The core package alone, then the lab beside it (still without a plugin: it must work with softmax alone)."""
    install(session, "-e", f"{CORE}[testing]", *XDIST)
    pytest(session, str(ROOT / "packages" / "attnkit" / "tests"), parallel=True)
    if (ROOT / "packages" / "attnkit-lab" / "pyproject.toml").exists():
        _lab_tests(session)


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
    path = ROOT / "plugins" / name
    install(session, "-e", f"{CORE}[testing]", "-e", str(path), *XDIST)
    session.env["ATTNKIT_STRICT_PLUGINS"] = "1"
    pytest(session, str(path / "tests"), "-m", "not triton", parallel=True)
    siblings = nox_siblings(path)
    if siblings:  # the tests marked `siblings` again, with the sibling plugins whose optional paths they use
        install(session, *[a for s in siblings for a in ("-e", str(ROOT / "plugins" / s))])
        pytest(session, str(path / "tests"), "-m", "siblings and not triton", parallel=True)


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
    pkgs = [f"{CORE}[testing]"] + ([LAB] if Path(LAB, "pyproject.toml").exists() else [])
    pkgs += [str(ROOT / "plugins" / p) for p in PLUGINS]
    install(session, *[a for p in pkgs for a in ("-e", p)], *XDIST)
    install(session, str(FIXTURES / "attnkit-thirdparty"))
    session.env["ATTNKIT_STRICT_PLUGINS"] = "1"
    session.env["ATTNKIT_FIXTURES"] = str(FIXTURES)
    session.env["ATTNKIT_CONSTRAINTS"] = CONSTRAINTS[1]
    session.run("attnkit", "list")
    tests_dir = ROOT / "integration_tests"
    # the third-party tests install and remove distributions in this venv: alone first, then the rest spread out
    pytest(session, str(tests_dir / "test_thirdparty_plugin.py"))
    pytest(session, str(tests_dir), "--ignore", str(tests_dir / "test_thirdparty_plugin.py"), parallel=True)
    # what the kernel and transformers tests see: this repository's packages, not the test fixture's plugin
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "attnkit-thirdparty")
    for name in ("ATTNKIT_STRICT_PLUGINS", "ATTNKIT_FIXTURES", "ATTNKIT_CONSTRAINTS"):
        del session.env[name]
    _kernel_tests(session)
    _transformers_tests(session)


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
