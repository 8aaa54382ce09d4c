"""``attnkit train --segment N``: segment-level training, state carried across segments, eval with/without memory."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import Attention, Capabilities
from attnkit_lab.models import LabModel, ModelConfig
from attnkit_lab.tasks import Batch
from attnkit_lab.train import segment_logits

TINY = ("--steps", "3", "--eval-every", "3", "--eval-batches", "1", "--batch-size", "4", "--dim", "16",
        "--heads", "2", "--depth", "1", "-q")


class ToyMemory(Attention):
    """Causal softmax over the previous segment's keys/values (kept, detached) and the segment's own."""

    capabilities = Capabilities(causal=True, noncausal=False, causal_cross=True, cross=False, streaming="segment")
    calls_with_memory = 0

    def _attend(self, q, k, v, ctx):
        mem = ctx.state
        if mem is not None:
            type(self).calls_with_memory += 1
            k, v = torch.cat([mem[0], k], 2), torch.cat([mem[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
                                             .tril(k.shape[2] - q.shape[2]))
        if not ctx.return_state:
            return out
        return out, (k[:, :, -4:].detach(), v[:, :, -4:].detach())

    def _init_state(self, batch, *, device, dtype):
        return None

    def _step(self, q, k, v, state):  # pragma: no cover - the lab trains with forward(state=...)
        raise NotImplementedError


@pytest.fixture
def toy_memory():
    ToyMemory.calls_with_memory = 0
    with attnkit.registered(ToyMemory, name="toy-memory", family="test", summary="toy segment memory",
                            approximation="softmax over previous segment + segment"):
        yield ToyMemory


def _run(cli, tmp_path, *args):
    out = tmp_path / "t"
    code, stdout, err = cli("train", *args, *TINY, "--out", str(out))
    assert code == 0, err
    return json.loads((out / "results.json").read_text()), stdout


def test_segment_training_reports_perplexity_with_and_without_memory(cli, tmp_path, corpus_file, toy_memory):
    data, stdout = _run(cli, tmp_path, "lm", "--attention", "toy-memory", "softmax", "--text", str(corpus_file),
                        "--vocab", "300", "--seq-len", "16", "--segment", "4")
    mem, soft = data["runs"]
    assert mem["status"] == "ok" and soft["status"] == "ok"
    assert mem["perplexity_no_memory"] is not None and mem["perplexity_no_memory"] != mem["perplexity"]
    assert soft["perplexity_no_memory"] is None            # softmax carries no segment memory
    assert toy_memory.calls_with_memory > 0
    assert "val ppl no memory" in stdout and "segments of 4" in stdout
    assert data["settings"]["segment"] == 4


def test_segment_logits_equal_whole_window_for_stateless_softmax():
    torch.manual_seed(0)
    model = LabModel(ModelConfig(vocab_size=11, num_outputs=11, max_len=12, dim=8, depth=1, heads=2))
    x = torch.randint(0, 11, (2, 12))
    whole = torch.cat([model(x[:, s:s + 4]) for s in range(0, 12, 4)], 1)
    torch.testing.assert_close(segment_logits(model, Batch(x, x), 4, memory=True), whole)
    assert not model.carries_segment_state()


def test_segment_refused_for_classify_and_negative(cli, tmp_path):
    code, _, err = cli("train", "listops", "--attention", "softmax", "--segment", "4", "--max-depth", "2",
                       "--max-args", "2", "--min-length", "4", "--max-length", "16", *TINY,
                       "--out", str(tmp_path / "a"))
    assert code != 0 and "--segment" in err
    code, _, err = cli("train", "copy", "--attention", "softmax", "--segment", "-1", *TINY,
                       "--out", str(tmp_path / "b"))
    assert code != 0 and "--segment" in err


def test_copy_trains_in_segments_with_memory(cli, tmp_path, toy_memory):
    data, stdout = _run(cli, tmp_path, "copy", "--attention", "toy-memory", "--seq-len", "16", "--vocab", "8",
                        "--segment", "4")
    r = data["runs"][0]
    assert r["status"] == "ok" and toy_memory.calls_with_memory > 0
    assert 0 <= r["eval_accuracy_no_memory"] <= 1 and r["eval_accuracy_no_memory"] == \
        r["curve"][-1]["eval_accuracy_no_memory"]
    assert "accuracy no memory" in stdout
