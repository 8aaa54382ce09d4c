"""Multi-query associative recall (MQAR), as in Zoology (Arora et al., 2023).

A sequence starts with ``num_kv_pairs`` key-value pairs ``k1 v1 k2 v2 ...``;
keys come from the lower half of the vocabulary, values from the upper half,
both without repetition inside a sequence. The rest of the sequence holds the
keys again as queries, at positions ``2·N + 2·gap`` where the gaps are drawn
without replacement from a power law ``p(g) ∝ g^(power_a - 1)`` (most queries
come soon after the context). At a query position the model must predict the
value bound to that key; the loss and accuracy count only those positions.
Other positions hold 0 (as in Zoology's Figure 2 runs) or random tokens
(``random_non_queries=True``).

Shapes: ``inputs`` (B, L) int64, ``targets`` (B, L) with -100 except at the
N query positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from attnkit.errors import UsageError

from .base import IGNORE, Batch, Task, seeded_generator


@dataclass
class MQARTask(Task):
    """Multi-query associative recall.

    Args:
        seq_len: tokens per sequence L (even, >= 4·num_kv_pairs).
        vocab: vocabulary size V (keys from [1, V/2), values from [V/2, V)).
        num_kv_pairs: key-value pairs N per sequence.
        power_a: exponent a of the power law over query gaps (Zoology: 0.01).
        random_non_queries: fill non-query positions with random tokens
            instead of 0 (Zoology's Figure 2 runs use 0).
    """

    name = "mqar"
    kind = "tokens"
    causal = True
    metric = "accuracy"
    summary = "multi-query associative recall (Zoology); accuracy on the N answers"

    seq_len: int = 64
    vocab: int = 256
    num_kv_pairs: int = 8
    power_a: float = 0.01
    random_non_queries: bool = False

    def __post_init__(self) -> None:
        if self.seq_len % 2:
            raise UsageError(f"mqar: --seq-len must be even, got {self.seq_len}")
        if self.num_kv_pairs < 1:
            raise UsageError(f"mqar: --num-kv-pairs must be >= 1, got {self.num_kv_pairs}")
        if 4 * self.num_kv_pairs > self.seq_len:
            raise UsageError(
                f"mqar: --seq-len must be at least 4 x --num-kv-pairs = {4 * self.num_kv_pairs}, got {self.seq_len}"
            )
        if self.vocab // 2 - 1 < self.num_kv_pairs:
            raise UsageError(
                f"mqar: --vocab must give at least --num-kv-pairs={self.num_kv_pairs} distinct keys "
                f"(keys come from [1, V/2)); need V >= {2 * (self.num_kv_pairs + 1)}, got {self.vocab}"
            )
        if not 0 < self.power_a <= 1:
            raise UsageError(f"mqar: --power-a must be in (0, 1], got {self.power_a}")

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def sample(self, batch_size: int, g: torch.Generator) -> Batch:
        """One batch drawn with generator ``g``."""
        B, L, N, V = batch_size, self.seq_len, self.num_kv_pairs, self.vocab
        half = V // 2
        keys = torch.rand(B, half - 1, generator=g).argsort(dim=1)[:, :N] + 1      # distinct in [1, V/2)
        values = torch.rand(B, V - half, generator=g).argsort(dim=1)[:, :N] + half  # distinct in [V/2, V)
        context = torch.empty(B, 2 * N, dtype=torch.long)
        context[:, 0::2] = keys
        context[:, 1::2] = values

        space = (L - 2 * N) // 2
        ranks = torch.arange(1, space + 1, dtype=torch.float64)
        p = self.power_a * ranks ** (self.power_a - 1)
        gaps = torch.multinomial((p / p.sum()).expand(B, space), N, replacement=False, generator=g)

        queries = torch.zeros(B, L - 2 * N + 1, dtype=torch.long)
        queries.scatter_(1, 2 * gaps, keys)
        seq = torch.cat([context, queries], dim=1)                               # (B, L + 1)
        labels = torch.full((B, L + 1), IGNORE, dtype=torch.long)
        labels.scatter_(1, 2 * gaps + 2 * N + 1, values)
        inputs, targets = seq[:, :-1].clone(), labels[:, 1:].clone()
        if self.random_non_queries:
            noise = torch.randint(V, inputs.shape, generator=g)
            inputs = torch.where(inputs == 0, noise, inputs)
        return Batch(inputs, targets)

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        g = seeded_generator(seed)
        while True:
            yield self.sample(batch_size, g)
