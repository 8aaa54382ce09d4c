"""Forwards that autograd runs again during backward (activation checkpointing).

``torch.utils.checkpoint`` drops a region's activations in forward and runs the region
again during backward to rebuild them. That second run must compute what the first one
did and change nothing: a training-time side effect (an auxiliary-loss record, an
EMA update of a buffer) must not happen twice, and state the first run updated must be
read as it was then. :func:`recomputing` tells an implementation which run it is in.
"""

from __future__ import annotations

import torch

__all__ = ["recomputing"]


def recomputing() -> bool:
    """True while autograd runs a backward pass: a forward called now is a recomputation (checkpointing).

    False while ``torch.compile`` traces (the question is not traced; a compiled region's recomputation is
    the compiler's own).
    """
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1
