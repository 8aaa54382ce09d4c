"""What the plugins' ``benchmarks/ab_revision.py`` scripts share: a plugin package exported from a git revision
under another name, calls alternated between it and the working tree, and the per-round ratio reported.

Separate runs minutes apart drift by 25-35% on the development VM, more than most changes being measured;
alternating both versions in one process, the order flipped each round, puts them on the same minutes. A
script imports this module by path (benchmarks are scripts, not packages)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "attnkit" / "benchmarks"))
    from ab_common import alternate, export, summary

Nothing here is a test.
"""

from __future__ import annotations

import io
import statistics
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path


def repo_root() -> Path:
    """The git checkout's top folder."""
    return Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())


def export(rev: str, pkg: str, dest: Path, name: str, namespace_file: str | None = None) -> Path:
    """The package at ``pkg`` (a path in the repository) as it was at ``rev``, written to ``dest/name`` (its imports
    must be relative). ``namespace_file``: a module of it, relative to the package, whose ``NAMESPACE = "<old>"``
    line (the custom operators' namespace) becomes ``NAMESPACE = "<name>"``, so both versions' operators can be
    registered in one process. Returns ``dest/name``."""
    data = subprocess.check_output(["git", "-C", str(repo_root()), "archive", rev, pkg])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    base = dest / name
    (dest / pkg).rename(base)
    if namespace_file is not None:
        old = Path(pkg).name
        f = base / namespace_file
        f.write_text(f.read_text().replace(f'NAMESPACE = "{old}"', f'NAMESPACE = "{name}"'))
    return base


def alternate(run: Callable[[str], float], rounds: int) -> dict[str, list[float]]:
    """``rounds`` rounds of ``run("base")`` and ``run("work")`` (each returns its seconds), the order flipped each
    round: the timings per side."""
    ts: dict[str, list[float]] = {"base": [], "work": []}
    for r in range(rounds):
        for side in (("base", "work") if r % 2 == 0 else ("work", "base")):
            ts[side].append(run(side))
    return ts


def summary(ts: dict[str, list[float]], digits: int = 1) -> str:
    """Each side's median (ms, ``digits`` decimals) and the median (quartiles) of the per-round ratio base / work
    (above 1: the working tree is faster)."""
    rat = sorted(a / b for a, b in zip(ts["base"], ts["work"], strict=True))
    n = len(rat)
    return (f"base {statistics.median(ts['base']) * 1e3:.{digits}f} ms, work "
            f"{statistics.median(ts['work']) * 1e3:.{digits}f} ms (medians of {n}); per-round base/work: median "
            f"{statistics.median(rat):.3f}, quartiles {rat[n // 4]:.3f}-{rat[(3 * n) // 4]:.3f}")
