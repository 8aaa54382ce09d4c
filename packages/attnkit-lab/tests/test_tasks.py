"""The task generators: structure, scoring positions, reproducibility."""

from __future__ import annotations

import random

import pytest
import torch

from attnkit.errors import UsageError
from attnkit_lab.tasks import IGNORE, CopyTask, ListOpsTask, LMTask, MQARTask, task_class
from attnkit_lab.tasks.base import seeded_generator
from attnkit_lab.tasks.listops import VOCAB, evaluate, generate_tree, tokens


def test_mqar_structure():
    t = MQARTask(seq_len=64, vocab=128, num_kv_pairs=8)
    b = t.sample(16, seeded_generator(3))
    assert b.inputs.shape == b.targets.shape == (16, 64)
    for x, y in zip(b.inputs, b.targets):
        keys, values = x[0:16:2], x[1:16:2]
        assert len(set(keys.tolist())) == 8 and bool(((keys >= 1) & (keys < 64)).all())
        assert bool(((values >= 64) & (values < 128)).all())
        binding = dict(zip(keys.tolist(), values.tolist()))
        scored = (y != IGNORE).nonzero().flatten()
        assert len(scored) == 8                         # one answer per key
        for pos in scored.tolist():
            assert pos >= 16 and x[pos].item() in binding     # a query sits at each scored position
            assert y[pos].item() == binding[x[pos].item()]     # and the target is its value


def test_mqar_reproducible_and_power_law():
    t = MQARTask(seq_len=128, vocab=256, num_kv_pairs=8)
    a = t.sample(64, seeded_generator(1))
    b = t.sample(64, seeded_generator(1))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    pos = (a.targets != IGNORE).nonzero()[:, 1].float()
    assert pos.mean() < 16 + (128 - 16) / 2       # queries come early more often than late


@pytest.mark.parametrize("kw, msg", [
    (dict(seq_len=63), "even"), (dict(seq_len=16, num_kv_pairs=8), "4 x"), (dict(vocab=10, num_kv_pairs=8), "--vocab"),
])
def test_mqar_bad_options(kw, msg):
    with pytest.raises(UsageError, match=msg):
        MQARTask(**kw)


def test_copy_structure():
    t = CopyTask(seq_len=20, vocab=8)
    b = t.sample(4, seeded_generator(0))
    n = 9
    for x, y in zip(b.inputs, b.targets):
        assert x[0] == 0 and x[n + 1] == 0
        assert torch.equal(x[1:n + 1], x[n + 2:])
        scored = (y != IGNORE).nonzero().flatten().tolist()
        assert scored == list(range(n + 1, 2 * n + 1))
        assert torch.equal(y[n + 1: 2 * n + 1], x[n + 2:])


def test_listops_evaluation():
    assert evaluate(("[MAX", [2, 9, ("[MIN", [4, 7]), 0])) == 9
    assert evaluate(("[MED", [1, 2, 3, 4])) == 2          # int(np.median([1,2,3,4])) = int(2.5)
    assert evaluate(("[MED", [5, 1, 9])) == 5
    assert evaluate(("[SM", [7, 8, 9])) == 4
    assert evaluate(("[MIN", [("[SM", [5, 5]), 3])) == 0
    tree, n = generate_tree(random.Random(1), 1, 6, 5)
    assert len(tokens(tree)) == n


def test_listops_batch():
    t = ListOpsTask(max_depth=4, max_args=4, min_length=8, max_length=48)
    b = t.sample(32, random.Random(0))
    lengths = b.key_padding_mask.sum(1)
    assert b.inputs.shape == (32, 48) and bool(((lengths > 8) & (lengths < 48)).all())
    assert bool((b.inputs[~b.key_padding_mask] == 0).all())
    assert bool(((b.targets >= 0) & (b.targets < 10)).all())
    inv = {v: k for k, v in VOCAB.items()}
    first = [inv[i] for i in b.inputs[0][: int(lengths[0])].tolist()]
    assert first[0].startswith("[") and first[-1] == "]"
    label, frac = ListOpsTask.majority_floor([b])
    assert 0.1 <= frac <= 1 and 0 <= label < 10


def test_listops_impossible_lengths():
    t = ListOpsTask(max_depth=2, max_args=2, min_length=100, max_length=200)
    with pytest.raises(UsageError, match="no expression"):
        t.sample_tree(random.Random(0), max_tries=200)


def test_lm_task_and_cache(corpus_file, tmp_path):
    logs = []
    t = LMTask(seq_len=16, vocab=300, text=(str(corpus_file),), log=logs.append)
    assert "trained" in logs[0]
    b = next(t.batches(4, 0))
    assert b.inputs.shape == (4, 16) and torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    ev = t.eval_batches(4, 2, 0)
    assert ev and all(int(x.inputs.max()) < t.vocab_size for x in ev)
    logs.clear()
    t2 = LMTask(seq_len=16, vocab=300, text=(str(corpus_file),), log=logs.append)
    assert "loaded from" in logs[0]                       # cached tokenizer
    assert torch.equal(t2.train_tokens, t.train_tokens)


def test_lm_default_corpus_is_stdlib():
    from attnkit_lab.corpus import stdlib_corpus

    c = stdlib_corpus(20_000)
    assert c.num_chars == 20_000 and c.files[0].endswith(".py") and "python-stdlib" in c.source
    assert stdlib_corpus(20_000).fingerprint() == c.fingerprint()


def test_lm_bad_corpora(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(UsageError, match="is empty"):
        LMTask(text=(str(empty),))
    with pytest.raises(UsageError, match="no such file"):
        LMTask(text=(str(tmp_path / "missing.txt"),))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a b c d e f g\n" * 3)
    with pytest.raises(UsageError, match="too small"):
        LMTask(text=(str(tiny),), vocab=300, seq_len=64)
    with pytest.raises(UsageError, match="--vocab 260 is too small"):
        LMTask(text=(str(tiny),), vocab=260, seq_len=4)


def test_unknown_task_suggests():
    with pytest.raises(UsageError, match="did you mean 'mqar'"):
        task_class("mqr")
