"""Progress bars on stderr, drawn by tqdm, and one-line status messages.

The bar is shown only on an interactive terminal: when stderr is not a TTY
(CI logs, pipes, files) or with ``--quiet`` (``enabled=False``) it draws
nothing, so logs hold results, not redraws. tqdm redraws in place, sizes
itself to the terminal and shows rate, elapsed time and ETA.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from tqdm import tqdm


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """Count ``total`` units of work (training steps, benchmark cells) and show how far along it is.

    Args:
        total: units of work; must be >= 0.
        desc: short label printed before the bar.
        stream: where to draw (default ``sys.stderr``).
        enabled: False draws nothing (``--quiet``); the bar is also off when
            ``stream`` is not a terminal.

    Use as a context manager; ``update(n, **postfix)`` advances by ``n`` and
    shows ``postfix`` (e.g. ``loss=0.53``) after the bar.

    Raises:
        ValueError: ``total`` below 0.
    """

    def __init__(self, total: int, desc: str = "", *, stream: TextIO | None = None, enabled: bool = True):
        if total < 0:
            raise ValueError(f"Progress: total must be >= 0, got {total}")
        self.total = int(total)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(enabled) and _isatty(self.stream)
        self.n = 0   # units done so far (counted also when nothing is drawn)
        self._bar = tqdm(total=self.total, desc=desc or None, file=self.stream, disable=not self.enabled,
                         dynamic_ncols=True, mininterval=0.1, leave=True)

    def update(self, n: int = 1, **postfix: object) -> None:
        """Advance by ``n``; ``postfix`` replaces the text after the bar."""
        self.n += n
        if self.enabled:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)

    def set_postfix(self, **postfix: object) -> None:
        """Replace the text after the bar (e.g. the configuration being measured)."""
        if self.enabled:
            self._bar.set_postfix(postfix)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def status(message: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
    """Print one status line on stderr (the channel progress uses); never fails on a closed stream."""
    if not enabled:
        return
    stream = stream if stream is not None else sys.stderr
    try:
        stream.write(message + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass
