"""``attnkit error`` on tiny sizes."""

from __future__ import annotations

import json

import torch

from attnkit_lab import names
from attnkit_lab.error import exact, rel_err


def test_error_budget_and_length_sweeps(cli, tmp_path, toy_mechanisms):
    out = tmp_path / "e"
    code, stdout, err = cli("error", "toy-noisy", "--lengths", "16,32", "--budgets", "4,64", "--budget-length", "32",
                            "--temperatures", "1,0.5", "--trials", "2", "--heads", "1", "--head-dim", "8",
                            "--out", str(out), "-q")
    assert code == 0, err
    for f in ("results.json", "results.csv", "table.md", "error.png"):
        assert (out / f).exists(), f
    data = json.loads((out / "results.json").read_text())
    assert data["budget_options"] == {"toy-noisy": "num_features"}
    by = {(r["sweep"], r["budget"], r["length"], r["dist"]): r for r in data["records"]}
    small, big = by[("budget", 4, 32, "gauss-t1")], by[("budget", 64, 32, "gauss-t1")]
    assert small["status"] == big["status"] == "ok"
    assert big["out_rel_err"] < small["out_rel_err"]          # more budget, less error
    assert 0.2 < small["out_rel_err"] / (4 ** -0.5) < 5
    assert "weights_rel_err" in small
    assert by[("length", 16, 16, "gauss-t0.5")]["status"] == "ok"
    assert "vs budget" in stdout


def test_error_from_trained_run(cli, tmp_path, toy_mechanisms):
    run = tmp_path / "run"
    code, _, err = cli("train", "mqar", "--attention", "softmax", "--steps", "2", "--eval-every", "1",
                       "--eval-batches", "1", "--batch-size", "4", "--seq-len", "32", "--vocab", "32",
                       "--num-kv-pairs", "4", "--dim", "16", "--heads", "2", "--out", str(run), "-q")
    assert code == 0, err
    out = tmp_path / "e"
    code, stdout, err = cli("error", "toy-noisy", "--lengths", "16,64", "--budgets", "4", "--budget-length", "64",
                            "--temperatures", "1", "--trials", "1", "--from-run", str(run), "--out", str(out), "-q")
    assert code == 0, err
    data = json.loads((out / "results.json").read_text())
    tr = [r for r in data["records"] if r["dist"] == "trained"]
    assert {r["status"] for r in tr} == {"ok"}
    assert sorted(r["length"] for r in tr if r["sweep"] == "length") == [16, 32]      # prefixes + the trained L
    assert [r["length"] for r in tr if r["sweep"] == "budget"] == [32]               # min(64, trained L)
    assert "softmax" in data["distributions"]["trained"]


def test_error_metrics_are_zero_for_exact():
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    ref = exact(q, k, v, False)
    assert rel_err(ref.float(), ref) < 1e-6
    eye = torch.eye(16, dtype=torch.float64).expand(1, 2, 16, 16)
    weights = exact(q, k, eye, True)
    assert torch.allclose(weights.sum(-1), torch.ones(1, 2, 16, dtype=torch.float64))
    assert float(weights[..., 0, 1:].abs().max()) == 0.0    # causal: first query sees only itself


def test_error_without_budget_option_and_bad_inputs(cli, tmp_path, toy_mechanisms):
    code, _, err = cli("error", "toy-noisy", "--budget-option", "rank", "--out", str(tmp_path / "x"), "-q")
    assert code == 2 and "--budget-option 'rank'" in err
    code, _, err = cli("error", "toy-noisy", "--from-run", str(tmp_path / "nope"), "--out", str(tmp_path / "y"))
    assert code == 2 and "no such file" in err
    empty = tmp_path / "emptyrun"
    empty.mkdir()
    code, _, err = cli("error", "toy-noisy", "--from-run", str(empty), "--lengths", "16", "--budgets", "4",
                       "--budget-length", "16", "--trials", "1", "--out", str(tmp_path / "z"), "-q")
    assert code == 2 and "no checkpoint.pt" in err
    assert not (tmp_path / "z").exists()


def test_budget_option_mapping(toy_mechanisms):
    assert names.budget_option(names.resolve_spec("toy-noisy")) == "num_features"
    assert names.budget_option(names.resolve_spec("softmax")) is None
