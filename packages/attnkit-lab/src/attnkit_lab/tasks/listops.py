"""ListOps, generated on the fly like the Long Range Arena generator.

A nested expression such as ``[MAX 2 9 [MIN 4 7 ] 0 ]`` is classified by its
value (0-9). Operators: ``MIN``, ``MAX``, ``MED`` (median, rounded down) and
``SM`` (sum modulo 10); values 0-9. A node at depth ``< max_depth`` is an
operator with probability 1/4 (else a value), with 2..``max_args``
arguments; trees whose token count is not strictly between ``min_length`` and
``max_length`` are rejected, as in LRA (Tay et al., 2021, which uses depth 10,
10 arguments, lengths 500-2000). LRA's files also carry parentheses that its
input pipeline strips; here the token sequence is produced directly.

Sequences are padded to ``max_length`` (pad id 0) with a key padding mask;
the model mean-pools the real tokens and classifies into 10 classes.
Shapes: ``inputs`` (B, max_length) int64, ``targets`` (B,) int64,
``key_padding_mask`` (B, max_length) bool.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from attnkit.errors import UsageError

from .base import Batch, Task

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
PAD = 0
# token ids: 0 = pad, 1..10 = digits 0-9, 11..14 = operators, 15 = "]"
VOCAB = {**{str(d): d + 1 for d in range(10)}, **{op: 11 + i for i, op in enumerate(OPERATORS)}, END: 15}
VALUE_P = 0.75  # probability that a node above the depth limit is a value (LRA: r > 0.25)

Tree = Any  # an int (a value) or (operator, [arguments])


def generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int) -> tuple[Tree, int]:
    """A random expression and its length in tokens (operator and ``]`` count 1 each)."""
    if depth >= max_depth or rng.random() < VALUE_P:
        return rng.randrange(10), 1
    op = rng.choice(OPERATORS)
    args = []
    length = 2
    for _ in range(rng.randint(2, max_args)):
        sub, n = generate_tree(rng, depth + 1, max_depth, max_args)
        args.append(sub)
        length += n
    return (op, args), length


def evaluate(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    op, args = tree
    vals = sorted(evaluate(a) for a in args)
    if op == "[MIN":
        return vals[0]
    if op == "[MAX":
        return vals[-1]
    if op == "[MED":
        m = len(vals) // 2
        return vals[m] if len(vals) % 2 else (vals[m - 1] + vals[m]) // 2  # int(np.median) for ints >= 0
    return sum(vals) % 10  # [SM


def tokens(tree: Tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    out = [op]
    for a in args:
        out.extend(tokens(a))
    out.append(END)
    return out


def to_string(tree: Tree) -> str:
    return " ".join(tokens(tree))


@dataclass
class ListOpsTask(Task):
    """ListOps classification.

    Args:
        max_depth: deepest operator nesting (LRA: 10).
        max_args: most arguments per operator (LRA: 10).
        min_length: shortest accepted expression, exclusive (LRA: 500).
        max_length: longest accepted expression, exclusive; also the padded
            sequence length L (LRA: 2000).
    """

    name = "listops"
    kind = "classify"
    causal = False
    metric = "accuracy"
    summary = "ListOps (LRA generator): classify the value 0-9 of a nested expression"

    seq_len: int = 0  # = max_length; set in __post_init__
    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise UsageError(f"listops: --max-depth must be >= 1, got {self.max_depth}")
        if self.max_args < 2:
            raise UsageError(f"listops: --max-args must be >= 2, got {self.max_args}")
        if self.min_length < 0 or self.max_length <= self.min_length + 1:
            raise UsageError(
                f"listops: need 0 <= --min-length < --max-length - 1 (lengths are exclusive bounds), "
                f"got --min-length {self.min_length} --max-length {self.max_length}"
            )
        if self.max_depth == 1 and self.min_length >= 1:
            raise UsageError("listops: --max-depth 1 only produces single values (length 1); raise --max-depth")
        self.seq_len = self.max_length

    @property
    def vocab_size(self) -> int:
        return len(VOCAB) + 1

    @property
    def num_outputs(self) -> int:
        return 10

    @property
    def pad_id(self) -> int:
        return PAD

    def sample_tree(self, rng: random.Random, max_tries: int = 1_000_000) -> Tree:
        for _ in range(max_tries):
            tree, n = generate_tree(rng, 1, self.max_depth, self.max_args)
            if self.min_length < n < self.max_length:
                return tree
        raise UsageError(
            f"listops: no expression with {self.min_length} < length < {self.max_length} in {max_tries} tries "
            f"with --max-depth {self.max_depth} --max-args {self.max_args}; "
            "widen the length range or allow deeper trees"
        )

    def sample(self, batch_size: int, rng: random.Random) -> Batch:
        L = self.max_length
        inputs = torch.full((batch_size, L), PAD, dtype=torch.long)
        targets = torch.empty(batch_size, dtype=torch.long)
        for i in range(batch_size):
            tree = self.sample_tree(rng)
            ids = [VOCAB[t] for t in tokens(tree)]
            inputs[i, : len(ids)] = torch.tensor(ids)
            targets[i] = evaluate(tree)
        return Batch(inputs, targets, inputs != PAD)

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        rng = random.Random(seed)
        while True:
            yield self.sample(batch_size, rng)

    def extra_info(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def majority_floor(batches: list[Batch]) -> tuple[int, float]:
        """The most frequent label of an evaluation set and its frequency."""
        counts: Counter[int] = Counter()
        for b in batches:
            counts.update(b.targets.tolist())
        label, n = counts.most_common(1)[0]
        return label, n / sum(counts.values())
