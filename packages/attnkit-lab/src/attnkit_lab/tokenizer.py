"""A sentencepiece tokenizer trained on a corpus, cached on disk.

Training settings keep text round-trippable (code included): identity
normalization, whitespace kept as is (``▁`` pieces, whitespace-only pieces
allowed), a ``"\\n"`` piece, byte fallback instead of ``<unk>``, digits split.
The model is keyed by the corpus fingerprint and the settings, written
atomically to ``<cache>/tokenizers/<key>.model``, and reused when present.

Cache directory: ``--cache-dir``, else ``$ATTNKIT_CACHE_DIR``, else the user
cache directory of ``platformdirs.user_cache_dir("attnkit")`` (``$XDG_CACHE_HOME/attnkit``
or ``~/.cache/attnkit`` on Linux), the one ``attnkit tune`` uses.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch

from attnkit.errors import UsageError

from .corpus import Corpus
from .results import atomic_write_bytes

TOKENIZER_SETTINGS_VERSION = 1


def cache_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``explicit``, else ``$ATTNKIT_CACHE_DIR``, else the platform's user cache directory for attnkit."""
    if explicit:
        return Path(explicit)
    if os.environ.get("ATTNKIT_CACHE_DIR"):
        return Path(os.environ["ATTNKIT_CACHE_DIR"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("attnkit"))


def _ensure_writable(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--cache-dir {str(d)!r} is not writable ({e.strerror or e})") from None
    if not os.access(d, os.W_OK):
        raise UsageError(f"--cache-dir {str(d)!r} is not writable")


def _lines(corpus: Corpus, max_line: int = 4000) -> list[str]:
    out = []
    for doc in corpus.documents:
        for line in doc.split("\n"):
            if line.strip():
                out.append(line[:max_line])
    return out


def train_tokenizer(corpus: Corpus, vocab_size: int, *, cache: str | os.PathLike[str] | None = None,
                    model_type: str = "bpe", seed: int = 0) -> tuple[Any, Path, bool]:
    """Train (or load from cache) a sentencepiece model.

    Returns:
        ``(processor, model_path, from_cache)``.
    """
    import sentencepiece as spm

    if vocab_size < 260:
        raise UsageError(f"--vocab must be >= 260 for the lm task (256 byte pieces + specials), got {vocab_size}")
    root = cache_dir(cache) / "tokenizers"
    _ensure_writable(root)
    key = hashlib.sha256(
        f"{corpus.fingerprint()}|{vocab_size}|{model_type}|{seed}|v{TOKENIZER_SETTINGS_VERSION}|"
        f"sp{spm.__version__}".encode()
    ).hexdigest()[:24]
    path = root / f"{key}.model"
    if path.exists():
        return spm.SentencePieceProcessor(model_file=str(path)), path, True
    lines = _lines(corpus)
    if not lines:
        raise UsageError("the corpus has no non-blank lines to train a tokenizer on")
    chars = set().union(*map(set, lines))
    need = 256 + 3 + len(chars)  # byte pieces, <unk>/</s>/"\n", one piece per distinct character
    if vocab_size < need:
        raise UsageError(f"--vocab {vocab_size} is too small for this corpus: it needs at least {need} "
                         f"(256 byte pieces, 3 special pieces and {len(chars)} distinct characters)")
    spm.set_random_generator_seed(seed)
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type=model_type,
            normalization_rule_name="identity", remove_extra_whitespaces=False, user_defined_symbols=["\n"],
            byte_fallback=True, allow_whitespace_only_pieces=True, split_digits=True, character_coverage=1.0,
            max_sentence_length=16384, num_threads=1, minloglevel=2, hard_vocab_limit=False,
            bos_id=-1, eos_id=1, unk_id=0, pad_id=-1,
        )
    except RuntimeError as e:
        raise UsageError(f"sentencepiece could not train a {vocab_size}-piece tokenizer on this corpus: {e}") from None
    atomic_write_bytes(path, buf.getvalue())
    return spm.SentencePieceProcessor(model_proto=buf.getvalue()), path, False


def encode_corpus(sp: Any, corpus: Corpus, *, model_path: Path, cache: str | os.PathLike[str] | None = None
                  ) -> tuple[torch.Tensor, bool]:
    """All documents as one int32 token stream, each document followed by EOS; cached."""
    root = cache_dir(cache) / "tokens"
    _ensure_writable(root)
    key = hashlib.sha256(f"{corpus.fingerprint()}|{model_path.stem}".encode()).hexdigest()[:24]
    path = root / f"{key}.pt"
    if path.exists():
        try:
            return torch.load(path, weights_only=True), True
        except Exception:  # a corrupt cache entry is rebuilt, never trusted
            pass
    eos = sp.eos_id()
    ids: list[int] = []
    for doc in corpus.documents:
        ids.extend(sp.encode(doc))
        if eos >= 0:
            ids.append(eos)
    tokens = torch.tensor(ids, dtype=torch.int32)
    buf = io.BytesIO()
    torch.save(tokens, buf)
    atomic_write_bytes(path, buf.getvalue())
    return tokens, False
