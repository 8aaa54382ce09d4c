"""Text corpora for the ``lm`` task.

The default corpus is built deterministically from the Python standard
library's source files of the running interpreter (every Python install has
them): the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]``, outside
``site-packages``, in sorted path order, until ``max_chars`` characters are
collected. ``--text FILE...`` takes any UTF-8 text instead (invalid bytes are
replaced, and counted in the corpus description).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.errors import UsageError


@dataclass
class Corpus:
    """Documents and where they came from.

    Attributes:
        documents: one string per file (tokenized separately).
        source: human-readable origin (``"python-stdlib 3.11.7"`` or file names).
        files: the files read, in order.
    """

    documents: list[str]
    source: str
    files: list[str] = field(default_factory=list)

    @property
    def num_chars(self) -> int:
        return sum(len(d) for d in self.documents)

    def fingerprint(self) -> str:
        """sha256 of the documents (keys the tokenizer and token caches)."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.encode("utf-8", errors="surrogatepass"))
            h.update(b"\x00")
        return h.hexdigest()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(max_chars: int) -> Corpus:
    """The first ``max_chars`` characters of the standard library's sources.

    Files are taken whole, in sorted order of their path relative to the
    stdlib root, until the budget is reached (the last file is truncated).
    """
    import platform

    if max_chars <= 0:
        raise UsageError(f"--corpus-chars must be > 0, got {max_chars}")
    root = stdlib_root()
    skip = {"site-packages", "dist-packages", "__pycache__"}
    paths = sorted(
        (p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    docs: list[str] = []
    files: list[str] = []
    total = 0
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not text.strip():
            continue
        text = text[: max_chars - total]
        docs.append(text)
        files.append(p.relative_to(root).as_posix())
        total += len(text)
        if total >= max_chars:
            break
    if not docs:
        raise UsageError(
            f"no Python source files found under the standard library at {str(root)!r}; pass --text FILE..."
        )
    return Corpus(docs, f"python-stdlib {platform.python_version()} ({len(files)} files, {total} chars)", files)


def text_corpus(paths: list[str], max_chars: int | None = None) -> Corpus:
    """Read ``--text`` files; a missing, unreadable or empty file is a usage error."""
    if not paths:
        raise UsageError("--text needs at least one FILE")
    docs: list[str] = []
    for name in paths:
        p = Path(name)
        if not p.exists():
            raise UsageError(f"--text {name!r}: no such file")
        if p.is_dir():
            raise UsageError(f"--text {name!r} is a directory; expected a text file")
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise UsageError(f"--text {name!r} cannot be read: {e.strerror or e}") from None
        if not text.strip():
            raise UsageError(f"--text {name!r} is empty; expected a non-empty text corpus")
        docs.append(text)
    if max_chars is not None:
        out, total = [], 0
        for d in docs:
            d = d[: max_chars - total]
            if d:
                out.append(d)
                total += len(d)
            if total >= max_chars:
                break
        docs = out
    names = [os.path.basename(p) for p in paths]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return Corpus(docs, f"text files: {shown} ({sum(len(d) for d in docs)} chars)", [str(p) for p in paths])
