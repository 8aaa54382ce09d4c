"""What a training task provides to :mod:`attnkit_lab.train`.

A task generates batches reproducibly from a seed and scores predictions. Two
kinds exist:

- ``"tokens"``: a causal sequence model; ``targets`` is ``(B, L)`` with
  ``-100`` where no loss is taken (e.g. MQAR keys, the first half of copy);
- ``"classify"``: one label per sequence; ``targets`` is ``(B,)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

IGNORE = -100


@dataclass
class Batch:
    """One batch.

    Attributes:
        inputs: ``(B, L)`` int64 token ids.
        targets: ``(B, L)`` int64 (``IGNORE`` where unscored) for ``tokens``
            tasks, ``(B,)`` for ``classify`` tasks.
        key_padding_mask: ``(B, L)`` bool, True = a real token; None when no
            position is padding.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    key_padding_mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Batch:
        kpm = self.key_padding_mask.to(device) if self.key_padding_mask is not None else None
        return Batch(self.inputs.to(device), self.targets.to(device), kpm)

    @property
    def num_tokens(self) -> int:
        return int(self.inputs.numel())


@dataclass
class Task:
    """Base class of the training tasks.

    Subclasses set the class attributes and implement :meth:`batches`.
    Instance attributes are the task's options (recorded in results).
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "tokens"       # "tokens" | "classify"
    causal: ClassVar[bool] = True
    metric: ClassVar[str] = "accuracy"   # headline metric: "accuracy" or "perplexity"
    summary: ClassVar[str] = ""

    seq_len: int = 64

    # -- interface -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def num_outputs(self) -> int:
        """Logits per position (``tokens``) or classes (``classify``)."""
        return self.vocab_size

    @property
    def pad_id(self) -> int | None:
        return None

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """An endless, reproducible stream of training batches."""
        raise NotImplementedError

    def eval_batches(self, batch_size: int, num_batches: int, seed: int) -> list[Batch]:
        """A fixed evaluation set (drawn from a stream seeded apart from training)."""
        it = self.batches(batch_size, seed)
        return [next(it) for _ in range(num_batches)]

    def options(self) -> dict[str, Any]:
        """The task's options, as recorded in results."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.repr}

    def extra_info(self) -> dict[str, Any]:
        """Facts worth printing and recording (e.g. the majority-class floor)."""
        return {}

    def describe(self) -> str:
        return self.summary


def seeded_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF)
    return g
