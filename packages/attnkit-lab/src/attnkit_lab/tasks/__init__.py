"""Training tasks: ``mqar``, ``listops``, ``copy``, ``lm``."""

from __future__ import annotations

import difflib

from attnkit.errors import UsageError

from .base import IGNORE, Batch, Task
from .copy import CopyTask
from .listops import ListOpsTask
from .lm import LMTask
from .mqar import MQARTask

TASKS: dict[str, type[Task]] = {t.name: t for t in (MQARTask, ListOpsTask, CopyTask, LMTask)}


def task_class(name: str) -> type[Task]:
    """The task named ``name``; an unknown name is a usage error that suggests close ones."""
    try:
        return TASKS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(TASKS), n=2, cutoff=0.4)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UsageError(f"unknown task {name!r}{hint} (tasks: {', '.join(TASKS)})") from None


__all__ = ["IGNORE", "TASKS", "Batch", "CopyTask", "LMTask", "ListOpsTask", "MQARTask", "Task", "task_class"]
