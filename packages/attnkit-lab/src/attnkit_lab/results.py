"""Result directories, atomic file writes, tables and the environment record.

A command never leaves a half-written result that looks complete: it works in
a hidden sibling directory (``.NAME.partial-XXXX``) created before any work
starts (so an unwritable destination fails at once), and renames it to the
destination only when everything is written. On an error the partial
directory is removed; on Ctrl-C (:func:`attnkit_lab.interrupts.is_interrupt`)
what was written so far is published (the commands mark their results
``"interrupted": true``), and an empty directory is removed.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from attnkit.errors import UsageError

from .interrupts import is_interrupt


def default_out_dir(command: str) -> Path:
    """``attnkit-runs/<command>-<YYYYmmdd-HHMMSS>`` under the working directory."""
    return Path("attnkit-runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


class RunDir:
    """The output directory of one command, published atomically.

    Args:
        path: destination directory (``--out``).
        force: replace an existing non-empty destination.
        option: the option name used in error messages (``--out``).

    Use as a context manager: files are written under :attr:`tmp` (use
    :meth:`file`); on normal exit the directory is renamed to :attr:`path`,
    on an exception it is deleted, on an interrupt what was written is kept
    (renamed to :attr:`path`; deleted if nothing was written).
    """

    def __init__(self, path: str | os.PathLike[str], *, force: bool = False, option: str = "--out"):
        self.path = Path(path)
        self.force = force
        self.option = option
        self.tmp: Path | None = None
        self.committed = False

    # -- lifecycle ------------------------------------------------------------
    def open(self) -> RunDir:
        p = self.path
        if p.exists() and not p.is_dir():
            raise UsageError(f"{self.option} {str(p)!r} exists and is not a directory; expected a directory path")
        if p.is_dir() and any(p.iterdir()) and not self.force:
            raise UsageError(
                f"{self.option} {str(p)!r} already exists and is not empty; "
                "choose another directory or pass --force to replace it"
            )
        parent = p.absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.partial-", dir=parent))
            self.tmp.chmod(0o777 & ~_umask())
        except OSError as e:
            raise UsageError(
                f"{self.option} {str(p)!r} is not writable: cannot create a directory in "
                f"{str(parent)!r} ({e.strerror or e})"
            ) from None
        return self

    def file(self, name: str) -> Path:
        """Path of a result file (inside the partial directory until commit)."""
        if self.tmp is None:
            raise RuntimeError("RunDir.file() before open()")
        f = self.tmp / name
        f.parent.mkdir(parents=True, exist_ok=True)
        return f

    def subdir(self, name: str) -> Path:
        """A sub-directory (e.g. one per attention) inside the run."""
        d = self.file(name)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def commit(self) -> Path:
        if self.tmp is None:
            raise RuntimeError("RunDir.commit() before open()")
        old = None
        if self.path.exists():
            if self.path.is_dir() and any(self.path.iterdir()):
                old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
                os.replace(self.path, old)
            else:
                self.path.rmdir()
        os.replace(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.tmp = None
        self.committed = True
        return self.path

    def abort(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def __enter__(self) -> RunDir:
        return self.open()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        elif is_interrupt(exc) and self.tmp is not None and any(self.tmp.iterdir()):
            self.commit()
        else:
            self.abort()

    # -- writers -------------------------------------------------------------
    def write_json(self, name: str, obj: Any) -> Path:
        return write_json(self.file(name), obj)

    def write_csv(self, name: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> Path:
        return write_csv(self.file(name), rows, columns)

    def write_text(self, name: str, text: str) -> Path:
        return atomic_write_text(self.file(name), text)


# -- atomic single-file writes --------------------------------------------------
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename (usual permissions)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def jsonable(x: Any) -> Any:
    """Plain JSON: non-finite floats become None, tuples lists, paths strings."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item):  # numpy / 0-d torch scalars
        try:
            return jsonable(x.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return repr(x)


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    text = json.dumps(jsonable(obj), indent=2, allow_nan=False) + "\n"
    return atomic_write_text(path, text)


def write_csv(path: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]],
              columns: Sequence[str] | None = None) -> Path:
    if columns is None:
        columns = []
        for r in rows:
            for k in r:
                if k not in columns:
                    columns.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _csv_value(r.get(k)) for k in columns})
    return atomic_write_text(path, buf.getvalue())


def _csv_value(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if not math.isfinite(v) else repr(v)
    if isinstance(v, (list, tuple)):
        return " ".join(str(i) for i in v)
    return v


# -- tables ---------------------------------------------------------------------
def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], *, align: str | None = None) -> str:
    """A Markdown pipe table (readable in a terminal, pasteable into docs).

    ``align``: one character per column, ``l`` or ``r`` (default: numbers right).
    """
    text_rows = [[_cell(c) for c in r] for r in rows]
    if align is None:
        align = "".join(
            "r" if all(_is_number(r[i]) for r in rows if i < len(r) and r[i] not in (None, "")) and rows else "l"
            for i in range(len(headers))
        )
    widths = [max([len(h)] + [len(r[i]) for r in text_rows if i < len(r)]) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        out = []
        for i, w in enumerate(widths):
            c = cells[i] if i < len(cells) else ""
            out.append(c.rjust(w) if align[i] == "r" else c.ljust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([fmt(list(headers)), sep] + [fmt(r) for r in text_rows])


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "—"
        return f"{v:.3g}" if (abs(v) < 1e-2 or abs(v) >= 1e4) and v != 0 else f"{v:.3f}".rstrip("0").rstrip(".")
    return str(v)


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_seconds(s: float | None) -> str:
    if s is None or (isinstance(s, float) and not math.isfinite(s)):
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


# -- environment ----------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _plugin_versions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {}
    try:
        eps: Iterable[Any] = metadata.entry_points(group="attnkit.plugins")
    except TypeError:  # Python < 3.10 API; kept for safety
        eps = metadata.entry_points().get("attnkit.plugins", [])  # type: ignore[attr-defined]
    for ep in eps:
        dist = getattr(ep, "dist", None)
        if dist is not None:
            out[dist.metadata["Name"]] = dist.version
    try:
        out.setdefault("attnkit", metadata.version("attnkit"))
    except metadata.PackageNotFoundError:
        pass
    return dict(sorted(out.items()))


# environment variables that change CPU timings (thread pools and how they wait)
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
              "NUMBA_THREADING_LAYER", "ATTNKIT_BACKEND")


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and os.path.basename(argv[0]) == "attnkit":
        argv[0] = "attnkit"
    return " ".join(argv)


def environment(device: str | None = None) -> dict[str, Any]:
    """Where and with what a result was produced (stored in every JSON)."""
    import torch

    env: dict[str, Any] = {
        "command": _command_line(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "packages": _plugin_versions(),
        "threads_env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
    }
    if device is not None:
        env["device"] = str(device)
        if str(device).startswith("cuda") and torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def machine_line(env: Mapping[str, Any]) -> str:
    """One line describing the machine, for tables and docs."""
    s = f"{env.get('cpu', '?')}, {env.get('cpu_count', '?')} CPUs ({env.get('torch_threads', '?')} torch threads)"
    if env.get("threads_env"):
        s += " [" + " ".join(f"{k}={v}" for k, v in env["threads_env"].items()) + "]"
    if env.get("gpu"):
        s = f"{env['gpu']}; host {s}"
    return s + f", torch {env.get('torch', '?')}, Python {env.get('python', '?')}"
