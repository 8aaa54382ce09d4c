"""Helpers of the lab's subprocess training tests (``test_train_resume.py``, ``test_train_nproc.py``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def cli(*args: str) -> list[str]:
    """The command line of ``attnkit ARGS`` in this interpreter."""
    return [sys.executable, "-m", "attnkit", *args]


def env() -> dict[str, str]:
    """This environment with one OpenMP thread per process (the runs share the test machine's cores)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def final(out: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A finished run's final parameters and its learning curve, from its output folder ``out``."""
    ckpt = torch.load(out / "softmax" / "checkpoint.pt", weights_only=False)
    runs = json.loads((out / "results.json").read_text())["runs"]
    return ckpt["state_dict"], runs[0]["curve"]
