"""``attnkit train`` on tiny sizes, one test per task, plus bad input."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import Attention, Capabilities

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
    (["mqar", "--attention", "softmax", "--dim", "10", "--heads", "4"], "--dim: expected a multiple of --heads=4"),
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


class _Spanned(Attention):
    """Exact attention with a learned span whose L1 penalty is recorded as the auxiliary loss ``span_l1``.

    The span does not enter the output: only the auxiliary loss gives it a gradient.
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.span = torch.nn.Parameter(torch.ones(4))

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        self.record_aux_loss("span_l1", self.span.abs().sum())
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_train_adds_and_logs_aux_losses(cli, tmp_path, monkeypatch):
    monkeypatch.setattr("attnkit_lab.progress._isatty", lambda stream: True)   # draw the bar into capsys
    import attnkit

    if getattr(attnkit, "aux_losses", None) is None:
        pytest.skip("this attnkit has no aux_losses (contract 2 not installed)")
    out = tmp_path / "t"
    with attnkit.registered(_Spanned, name="toy-span", family="test", summary="records span_l1",
                            aux_losses={"span_l1": 0.5}):
        code, stdout, err = cli("train", "mqar", "--attention", "toy-span", "softmax", "--steps", "3",
                                "--eval-every", "2", "--eval-batches", "1", "--batch-size", "2", "--dim", "8",
                                "--heads", "1", "--depth", "1", "--seq-len", "16", "--vocab", "16",
                                "--num-kv-pairs", "2", "--out", str(out))
    assert code == 0, err
    data = json.loads((out / "results.json").read_text())
    span, soft = data["runs"]
    assert span["status"] == "ok" and soft["aux_losses"] == {}
    # weighted by the spec's default weight: 0.5 x |span|_1 = 0.5 x 4 at the start, a little less after
    assert span["aux_losses"]["span_l1"] == pytest.approx(2.0, rel=1e-2) and span["aux_losses"]["span_l1"] < 2.0
    assert [sorted(p["aux_losses"]) for p in span["curve"]] == [["span_l1"], ["span_l1"]]
    # it was added to the loss: the span (outside the output) moved, so it had a gradient
    state = torch.load(out / span["checkpoint"], weights_only=False)["state_dict"]
    spans = [v for k, v in state.items() if k.endswith(".span")]
    assert spans and all(bool((s < 1).all()) for s in spans)
    # logged in the CSVs, the table and the progress line
    assert "aux:span_l1" in (out / "curves.csv").read_text().splitlines()[0]
    assert "aux:span_l1" in (out / "results.csv").read_text().splitlines()[0]
    assert "aux losses" in stdout and f"span_l1 {span['aux_losses']['span_l1']:.3g}" in stdout
    assert "span_l1=" in err


class _Penalised(Attention):
    """Exact attention (contract 2, ``_attend``) that records the auxiliary loss ``penalty`` = its parameter
    ``w`` (2.0 at init) at every forward; ``w`` does not enter the output."""

    capabilities = Capabilities(mask_kinds=("causal", "key_padding"), backends=("torch",))

    def __init__(self, **kw):
        super().__init__(**kw)
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def _attend(self, q, k, v, ctx):
        self.record_aux_loss("penalty", self.w * 1.0)
        keep = ctx.dense_keep()
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=ctx.scale)


def test_train_aux_losses_from_evaluation_do_not_leak_into_training(cli, tmp_path, monkeypatch):
    """One forward per training step records 0.5 x w (w ~ 2, weight 0.5); every evaluation pass records
    three more forwards, which ``attnkit.clear_aux_losses`` must drop before the next step."""
    monkeypatch.setattr("attnkit_lab.progress._isatty", lambda stream: True)   # draw the bar into capsys
    import attnkit

    if getattr(attnkit, "clear_aux_losses", None) is None:
        pytest.skip("this attnkit has no clear_aux_losses (contract 2 not installed)")
    cleared = []
    real_clear = attnkit.clear_aux_losses
    monkeypatch.setattr(attnkit, "clear_aux_losses", lambda model: (cleared.append(1), real_clear(model))[1])
    out = tmp_path / "t"
    with attnkit.registered(_Penalised, name="toy-penalised", family="test", summary="records a penalty",
                            capabilities=_Penalised.capabilities, aux_losses={"penalty": 0.5}):
        code, _, err = cli("train", "mqar", "--attention", "toy-penalised", "--steps", "4", "--eval-every", "1",
                           "--eval-batches", "3", "--batch-size", "2", "--dim", "8", "--heads", "1", "--depth", "1",
                           "--seq-len", "16", "--vocab", "16", "--num-kv-pairs", "2", "--out", str(out))
    assert code == 0, err
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["status"] == "ok" and len(cleared) >= 4                # once per evaluation pass at least
    history = [p["aux_losses"]["penalty"] for p in run["curve"]]
    assert len(history) == 4
    # w moves by about lr per step: one training forward gives 0.5 x w in (0.98, 1]; a leaked evaluation
    # (3 more forwards) would log about 4 for the next step (1.3 after the moving average)
    assert all(0.98 < h <= 1.0 for h in history), history
    assert run["aux_losses"]["penalty"] == pytest.approx(history[-1])
    w = torch.load(out / run["checkpoint"], weights_only=False)["state_dict"]
    assert [v.item() < 2.0 for k, v in w.items() if k.endswith(".w")] == [True]   # the penalty had a gradient
    assert "penalty=" in err                                          # the progress line


class _Reporting(Attention):
    """Exact attention with a ``lab_stats()`` hook (what adaptive spans, entmax and ACT use to report)."""

    capabilities = Capabilities(mask_kinds=("causal", "key_padding"), backends=("torch",))

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def _attend(self, q, k, v, ctx):
        self.calls += 1
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=ctx.dense_keep(), scale=ctx.scale)

    def lab_stats(self):
        return {"calls": self.calls, "spans": [1.5, 2.0]}


def test_train_logs_module_stats_and_takes_a_block(cli, tmp_path):
    import attnkit

    out = tmp_path / "t"
    with attnkit.registered(_Reporting, name="toy-reporting", family="test", summary="reports lab_stats",
                            capabilities=_Reporting.capabilities):
        code, stdout, err = cli("train", "mqar", "--attention", "toy-reporting", "--steps", "2", "--eval-every", "1",
                                "--eval-batches", "1", "--batch-size", "2", "--dim", "8", "--heads", "1",
                                "--depth", "2", "--block", "pre-norm@mlp_ratio=0", "--seq-len", "16", "--vocab", "16",
                                "--num-kv-pairs", "2", "--out", str(out))
    assert code == 0, err
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["status"] == "ok"
    # two blocks built with build_block (the stack of blocks, not attnkit.Transformer), each reporting
    keys = sorted(run["stats"])
    assert keys == ["body.blocks.0.attn.attention.calls", "body.blocks.0.attn.attention.spans",
                    "body.blocks.1.attn.attention.calls", "body.blocks.1.attn.attention.spans"]
    assert [sorted(p["stats"]) == keys for p in run["curve"]] == [True, True]
    assert run["curve"][1]["stats"]["body.blocks.0.attn.attention.calls"] > run["curve"][0]["stats"][
        "body.blocks.0.attn.attention.calls"]
    assert "module stats" in stdout and "[1.5 2]" in stdout
    state = torch.load(out / run["checkpoint"], weights_only=False)["state_dict"]
    assert not any("mlp" in k for k in state)            # the block option reached the block


def test_train_bad_block(cli, tmp_path):
    code, _, err = cli("train", "mqar", "--block", "act@", "--out", str(tmp_path / "t"))
    assert code != 0 and "--block" in err
