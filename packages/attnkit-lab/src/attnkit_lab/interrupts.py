"""Ctrl-C: recognising an interrupt, and stopping a run once its results so far are written.

A KeyboardInterrupt raised while a numba-compiled kernel runs reaches Python as
a ``SystemError`` ("... returned a result with an exception set") whose
``__context__`` or ``__cause__`` is the KeyboardInterrupt. The sweeps record
ordinary exceptions per mechanism and go on, so they must tell an interrupt
apart first: :func:`is_interrupt`.

A run that sees an interrupt stops at once, writes what it has measured so far
(JSON, CSV and table, marked ``"interrupted": true``; no plots) and raises
:class:`Interrupted`. The command line then publishes the run directory,
prints where it is and exits with status 130.
"""

from __future__ import annotations

__all__ = ["Interrupted", "is_interrupt", "raise_if_interrupt"]


class Interrupted(KeyboardInterrupt):
    """An interrupt after the run wrote its results so far (see :mod:`attnkit_lab.interrupts`).

    Args:
        where: what was running when the interrupt came (e.g. ``"train mqar softmax, step 12"``).
    """

    def __init__(self, where: str = "") -> None:
        super().__init__(where)
        self.where = where


def is_interrupt(exc: BaseException | None) -> bool:
    """True for a KeyboardInterrupt, or a SystemError whose cause/context chain holds one."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    if not isinstance(exc, SystemError):
        return False
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return False


def raise_if_interrupt(exc: BaseException) -> None:
    """Re-raise ``exc`` as a KeyboardInterrupt when it is an interrupt; else return.

    Used first thing in every ``except Exception`` that records a failure and goes on.
    """
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    if is_interrupt(exc):
        raise KeyboardInterrupt(f"interrupted ({type(exc).__name__}: {exc})") from exc
