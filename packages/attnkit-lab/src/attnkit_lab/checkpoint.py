"""Resumable training: periodic checkpoints written atomically, and resuming from them.

``attnkit train --checkpoint-every N --checkpoint-dir DIR`` saves, every N
steps and per attention, ``DIR/<label>/state.pt``: the model, the optimizer,
the step (the learning-rate schedule is a function of it), the RNG states
(torch CPU, CUDA where used, Python's ``random``), the data position (the
number of training batches drawn: the stream is reproducible from the seed and
is fast-forwarded on resume), the moving averages and the curve so far. The
file is written to a temporary name in the same directory, flushed to disk and
renamed over the old one (``os.replace``), so a run killed at any point
(SIGKILL included) leaves the previous complete checkpoint (and at most a
hidden ``.state.pt.*.tmp``, removed by the next save).

``attnkit train --resume DIR`` (same task, attentions and settings) continues
each attention from its checkpoint; the resumed run ends with exactly the
parameters of the uninterrupted one (on the same machine and thread count).
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnkit.errors import UsageError

__all__ = ["FORMAT", "Checkpointing", "atomic_save", "load_state", "rng_state", "set_rng_state"]

FORMAT = "attnkit-lab-train-state/1"


@dataclass
class Checkpointing:
    """Where and how often to checkpoint; ``resume``: continue from what ``directory`` holds."""

    directory: Path
    every: int = 0
    resume: bool = False

    def path(self, folder: str) -> Path:
        """``DIR/<folder>/state.pt``; ``folder`` is the attention's file-safe label (``train.safe_label``)."""
        return self.directory / folder / "state.pt"


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then ``os.replace`` (atomic on POSIX)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer killed mid-write (SIGKILL)
            stale.unlink(missing_ok=True)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_state(path: Path, *, expect: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (None if there is none); UsageError if it belongs to another run."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"--resume: {str(path)!r} is not an attnkit train checkpoint ({FORMAT})")
    for key, want in expect.items():
        if state.get(key) != want:
            raise UsageError(f"--resume: {str(path)!r} was written with another {key} ({state.get(key)!r}); "
                             f"this run has {want!r}: resume with the same task, attention and settings")
    return state


def rng_state(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
