"""A dependency-free progress bar on stderr.

On a terminal the bar redraws in place (``\\r``) at most ten times a second; when
stderr is not a terminal (CI logs, pipes) it prints a plain line at every 10 %
step instead, so logs stay short. ``enabled=False`` silences it.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _fmt_seconds(s: float) -> str:
    if s != s or s == float("inf"):  # NaN / inf
        return "?"
    s = int(round(s))
    m, s = divmod(s, 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Count ``total`` units of work and show how far along it is.

    Args:
        total: units of work (e.g. training steps); must be >= 0.
        desc: short label printed before the bar.
        stream: where to draw (default ``sys.stderr``).
        enabled: False draws nothing.
        width: characters of the bar itself.

    Use as a context manager; ``update(n, **postfix)`` advances by ``n`` and
    shows ``postfix`` (e.g. ``loss=0.53``) after the bar.
    """

    def __init__(self, total: int, desc: str = "", *, stream: TextIO | None = None,
                 enabled: bool = True, width: int = 24):
        if total < 0:
            raise ValueError(f"Progress: total must be >= 0, got {total}")
        self.total = int(total)
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.n = 0
        self.postfix = ""
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1
        try:
            self._tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self._tty = False

    # -- public ------------------------------------------------------------
    def update(self, n: int = 1, **postfix: object) -> None:
        self.n = min(self.total, self.n + n) if self.total else self.n + n
        if postfix:
            self.postfix = " ".join(f"{k}={_fmt_value(v)}" for k, v in postfix.items())
        self._maybe_draw()

    def set_postfix(self, **postfix: object) -> None:
        self.postfix = " ".join(f"{k}={_fmt_value(v)}" for k, v in postfix.items())
        self._maybe_draw()

    def close(self) -> None:
        if not self.enabled:
            return
        self._draw(final=True)

    def __enter__(self) -> Progress:
        if self.enabled and self._tty:
            self._draw()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- drawing -------------------------------------------------------------
    def line(self) -> str:
        elapsed = time.perf_counter() - self._start
        frac = self.n / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        eta = elapsed / self.n * (self.total - self.n) if self.n else float("nan")
        head = f"{self.desc}: " if self.desc else ""
        tail = f" {self.postfix}" if self.postfix else ""
        return (f"{head}[{bar}] {self.n}/{self.total} {100 * frac:3.0f}% "
                f"{_fmt_seconds(elapsed)}<{_fmt_seconds(eta)}{tail}")

    def _maybe_draw(self) -> None:
        if not self.enabled:
            return
        if self._tty:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or self.n >= self.total:
                self._draw()
        else:
            decile = int(10 * self.n / self.total) if self.total else 10
            if decile > self._last_decile and decile < 10:
                self._last_decile = decile
                self._draw()

    def _draw(self, final: bool = False) -> None:
        self._last_draw = time.perf_counter()
        text = self.line()
        try:
            if self._tty:
                self.stream.write("\r\033[K" + text + ("\n" if final else ""))
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream never stops the work
            self.enabled = False


def _fmt_value(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def status(message: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
    """Print one status line on stderr (the channel progress uses)."""
    if not enabled:
        return
    stream = stream if stream is not None else sys.stderr
    try:
        stream.write(message + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass
