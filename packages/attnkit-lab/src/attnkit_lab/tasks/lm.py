"""Next-token language modelling with a sentencepiece tokenizer.

The corpus (the standard library's sources by default, or ``--text FILE...``)
is tokenized with a sentencepiece model trained on it and cached (see
:mod:`attnkit_lab.tokenizer`). The token stream (documents in order, each
followed by EOS) is split by position: the last ``val_fraction`` is the
validation split, so validation text is never seen in training. Training
batches are windows at random offsets of the training split; the evaluation
set is the first consecutive non-overlapping windows of the validation split.

Shapes: ``inputs`` and ``targets`` (B, L) int64, targets shifted by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit.errors import UsageError

from ..corpus import Corpus, stdlib_corpus, text_corpus
from ..tokenizer import encode_corpus, train_tokenizer
from .base import Batch, Task, seeded_generator


@dataclass
class LMTask(Task):
    """Language modelling.

    Args:
        seq_len: tokens per training window L.
        vocab: sentencepiece vocabulary size.
        text: corpus files; empty = the Python standard library's sources.
        corpus_chars: characters taken from the corpus (the stdlib corpus is
            cut at this size; ``--text`` corpora too).
        val_fraction: fraction of the token stream held out for validation.
        cache_dir: tokenizer/token cache (None: the default cache directory).
        log: print what is being built (tokenizer training can take seconds).
    """

    name = "lm"
    kind = "tokens"
    causal = True
    metric = "perplexity"
    summary = "next-token LM with a sentencepiece tokenizer; validation loss and perplexity"

    seq_len: int = 128
    vocab: int = 2048
    text: tuple[str, ...] = ()
    corpus_chars: int = 2_000_000
    val_fraction: float = 0.1
    cache_dir: str | None = field(default=None, repr=False)
    log: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise UsageError(f"lm: --val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.seq_len < 2:
            raise UsageError(f"lm: --seq-len must be >= 2, got {self.seq_len}")
        self.text = tuple(self.text)
        say = self.log or (lambda msg: None)
        corpus: Corpus = (text_corpus(list(self.text), self.corpus_chars) if self.text
                          else stdlib_corpus(self.corpus_chars))
        self.corpus_source = corpus.source
        sp, path, cached = train_tokenizer(corpus, self.vocab, cache=self.cache_dir)
        say(f"lm: tokenizer {'loaded from' if cached else 'trained and cached at'} {path}")
        self.sp = sp
        self.tokenizer_path = str(path)
        tokens, _ = encode_corpus(sp, corpus, model_path=path, cache=self.cache_dir)
        n_val = int(len(tokens) * self.val_fraction)
        self.train_tokens = tokens[: len(tokens) - n_val].long()
        self.val_tokens = tokens[len(tokens) - n_val:].long()
        need = self.seq_len + 1
        if len(self.train_tokens) < need or len(self.val_tokens) < need:
            raise UsageError(
                f"lm: the corpus is too small: {len(tokens)} tokens give {len(self.train_tokens)} for training and "
                f"{len(self.val_tokens)} for validation, each needs at least --seq-len + 1 = {need}; "
                "use a larger corpus or a smaller --seq-len"
            )
        say(f"lm: corpus {corpus.source}: {len(tokens)} tokens "
            f"({len(self.train_tokens)} train / {len(self.val_tokens)} validation)")

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def options(self) -> dict[str, Any]:
        d = super().options()
        d["text"] = list(self.text)
        return d

    def extra_info(self) -> dict[str, Any]:
        return {
            "corpus": self.corpus_source,
            "tokenizer": self.tokenizer_path,
            "vocab_size": self.vocab_size,
            "train_tokens": len(self.train_tokens),
            "val_tokens": len(self.val_tokens),
        }

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        g = seeded_generator(seed)
        L, stream = self.seq_len, self.train_tokens
        hi = len(stream) - L - 1
        while True:
            starts = torch.randint(0, hi + 1, (batch_size,), generator=g)
            idx = starts[:, None] + torch.arange(L + 1)
            win = stream[idx]
            yield Batch(win[:, :-1].contiguous(), win[:, 1:].contiguous())

    def eval_batches(self, batch_size: int, num_batches: int, seed: int) -> list[Batch]:
        L, stream = self.seq_len, self.val_tokens
        n_windows = min(batch_size * num_batches, (len(stream) - 1) // L)
        out = []
        for b0 in range(0, n_windows, batch_size):
            starts = torch.arange(b0, min(b0 + batch_size, n_windows)) * L
            idx = starts[:, None] + torch.arange(L + 1)
            win = stream[idx]
            out.append(Batch(win[:, :-1].contiguous(), win[:, 1:].contiguous()))
        return out
