"""The Reformer duplication task (Kitaev et al., 2020, §5): ``0 w 0 w``.

``w`` is a word of ``seq_len/2 - 1`` symbols drawn uniformly from
``1..vocab-1``; 0 is the separator. The model reads the whole sequence
causally; only the predictions of the second copy of ``w`` are scored (the
first half is random and cannot be predicted).

Shapes: ``inputs`` (B, L) int64 with ``L = seq_len``; ``targets`` (B, L) holds
the next token at positions ``n+1 .. 2n`` (``n = len(w)``), -100 elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from attnkit.errors import UsageError

from .base import IGNORE, Batch, Task, seeded_generator


@dataclass
class CopyTask(Task):
    """Sequence duplication.

    Args:
        seq_len: length L of ``0w0w`` (even, >= 4); ``len(w) = L/2 - 1``.
        vocab: vocabulary size (symbols ``1..vocab-1`` plus the separator 0).
    """

    name = "copy"
    kind = "tokens"
    causal = True
    metric = "accuracy"
    summary = "duplication 0w0w (Reformer); accuracy on the second copy of w"

    seq_len: int = 64
    vocab: int = 16

    def __post_init__(self) -> None:
        if self.seq_len % 2 or self.seq_len < 4:
            raise UsageError(f"copy: --seq-len must be even and >= 4, got {self.seq_len}")
        if self.vocab < 3:
            raise UsageError(f"copy: --vocab must be >= 3 (0 is the separator), got {self.vocab}")

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def sample(self, batch_size: int, g: torch.Generator) -> Batch:
        n = self.seq_len // 2 - 1
        w = torch.randint(1, self.vocab, (batch_size, n), generator=g)
        zero = torch.zeros(batch_size, 1, dtype=torch.long)
        seq = torch.cat([zero, w, zero, w], dim=1)                      # (B, L)
        targets = torch.full_like(seq, IGNORE)
        targets[:, n + 1: 2 * n + 1] = seq[:, n + 2: 2 * n + 2]          # predict the second w
        return Batch(seq, targets)

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        g = seeded_generator(seed)
        while True:
            yield self.sample(batch_size, g)
