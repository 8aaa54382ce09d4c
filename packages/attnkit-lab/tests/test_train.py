"""``attnkit train`` on tiny sizes, one test per task, plus bad input."""

from __future__ import annotations

import json

import pytest
import torch

TINY = ("--steps", "3", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "4", "--dim", "16",
        "--heads", "2", "--depth", "1", "-q")


def _run(cli, tmp_path, *args):
    out = tmp_path / "t"
    code, stdout, err = cli("train", *args, *TINY, "--out", str(out))
    assert code == 0, err
    data = json.loads((out / "results.json").read_text())
    return out, data, stdout


def test_train_mqar(cli, tmp_path):
    out, data, stdout = _run(cli, tmp_path, "mqar", "--attention", "softmax", "softmax@backend=torch",
                             "--seq-len", "32", "--vocab", "32", "--num-kv-pairs", "4")
    for f in ("results.json", "results.csv", "curves.csv", "table.md", "learning_curves.png"):
        assert (out / f).exists(), f
    runs = data["runs"]
    assert [r["label"] for r in runs] == ["softmax", "softmax@backend=torch"]
    for r in runs:
        assert r["status"] == "ok" and 0 <= r["eval_accuracy"] <= 1 and r["tokens_per_s"] > 0
        assert r["peak_bytes"] > 0 and r["params"] > 0 and [p["step"] for p in r["curve"]] == [2, 3]
        assert (out / r["checkpoint"]).exists()
    # same seed, same data, same init: two backends of exact attention agree
    assert runs[0]["curve"][0]["train_loss"] == pytest.approx(runs[1]["curve"][0]["train_loss"], rel=1e-4)
    assert "accuracy" in stdout and data["task"]["options"]["num_kv_pairs"] == 4


def test_train_is_reproducible(cli, tmp_path):
    args = ("mqar", "--attention", "softmax", "--seq-len", "16", "--vocab", "16", "--num-kv-pairs", "2")
    _, a, _ = _run(cli, tmp_path / "a", *args)
    _, b, _ = _run(cli, tmp_path / "b", *args)
    assert a["runs"][0]["curve"][-1]["eval_loss"] == b["runs"][0]["curve"][-1]["eval_loss"]


def test_train_listops_prints_majority_floor(cli, tmp_path):
    _, data, stdout = _run(cli, tmp_path, "listops", "--attention", "softmax", "--max-depth", "3",
                           "--max-args", "3", "--min-length", "4", "--max-length", "32")
    assert "majority-class floor" in stdout and 0 < data["task"]["info"]["majority_floor"] <= 1
    assert data["runs"][0]["status"] == "ok"


def test_train_copy(cli, tmp_path):
    _, data, _ = _run(cli, tmp_path, "copy", "--attention", "softmax", "--seq-len", "16", "--vocab", "8")
    assert data["runs"][0]["status"] == "ok"


def test_train_lm_reports_perplexity(cli, tmp_path, corpus_file):
    _, data, stdout = _run(cli, tmp_path, "lm", "--attention", "softmax", "--text", str(corpus_file),
                           "--vocab", "300", "--seq-len", "16")
    r = data["runs"][0]
    assert r["status"] == "ok" and r["perplexity"] == pytest.approx(torch.tensor(r["eval_loss"]).exp().item(), rel=1e-5)
    assert "val ppl" in stdout and data["task"]["info"]["vocab_size"] <= 300


def test_train_records_a_mechanism_that_cannot_run(cli, tmp_path, toy_mechanisms):
    _, data, _ = _run(cli, tmp_path, "mqar", "--attention", "toy-noncausal", "softmax",
                      "--seq-len", "16", "--vocab", "16", "--num-kv-pairs", "2")
    bad, good = data["runs"]
    assert bad["status"] == "skipped" and "causal" in bad["note"] and good["status"] == "ok"


@pytest.mark.parametrize("args, msg", [
    (["mqr", "--attention", "softmax"], "did you mean 'mqar'"),
    (["mqar", "--attention", "sofmax"], "did you mean 'softmax'"),
    (["copy", "--attention", "softmax", "--num-kv-pairs", "3"], "--num-kv-pairs applies to mqar"),
    (["mqar", "--attention", "softmax", "--dim", "10", "--heads", "4"], "--dim must be a multiple"),
    (["lm", "--attention", "softmax", "--text", "/nonexistent/corpus.txt"], "no such file"),
])
def test_train_bad_input(cli, tmp_path, args, msg):
    out = tmp_path / "t"
    code, _, err = cli("train", *args, "--out", str(out), "-q")
    assert code == 2 and msg in err and "Traceback" not in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_train_empty_corpus(cli, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, _, err = cli("train", "lm", "--attention", "softmax", "--text", str(empty), "--out", str(tmp_path / "t"))
    assert code == 2 and "is empty" in err
    assert not (tmp_path / "t").exists()


def test_train_unwritable_out(cli, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = cli("train", "mqar", "--attention", "softmax", "--out", str(tmp_path / "file" / "out"))
    assert code == 2 and "not writable" in err
