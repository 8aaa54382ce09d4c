"""The lab plugs into the attnkit CLI through the entry point and the command hook."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from attnkit_lab import cli as lab_cli


def test_entry_point_and_commands(cli):
    eps = [ep for ep in md.entry_points(group="attnkit.plugins") if ep.name == "lab"]
    assert eps and eps[0].value == "attnkit_lab.plugin"
    with pytest.raises(SystemExit):
        cli("--help")


def test_help_lists_commands(capsys):
    from attnkit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("bench", "error", "train", "demo"):
        assert name in out


def test_parse_lengths():
    assert lab_cli.parse_int_list("256..2K", option="--lengths") == [256, 512, 1024, 2048]
    assert lab_cli.parse_int_list("1k, 64,64", option="--lengths") == [64, 1024]


def test_choice_syntax():
    from attnkit_lab.names import parse_choice

    c = parse_choice("performer@num_features=64,orthogonal=false,feature_map=trig")
    assert c.name == "performer" and c.options == {"num_features": 64, "orthogonal": False, "feature_map": "trig"}
    from attnkit.errors import UsageError

    with pytest.raises(UsageError, match="key=value"):
        parse_choice("performer@64")


def test_demo_tiny(cli, tmp_path, monkeypatch):
    """The demo end to end, with the quick presets shrunk to toy sizes."""
    from attnkit_lab import cli as c

    monkeypatch.setattr(c, "bench_presets", lambda: {"quick": dict(lengths=[16, 32], batch=1, heads=1, head_dim=8,
                                                                   repeats=1, warmup=1, time_limit=10.0)})
    monkeypatch.setattr(c, "error_presets", lambda: {"quick": dict(lengths=[16], budgets=[4], budget_length=16,
                                                                   temperatures=[1.0], trials=1, batch=1, heads=1,
                                                                   head_dim=8, weights_max_length=16)})
    monkeypatch.setitem(c.TRAIN_PRESETS, "mqar", {"quick": (
        dict(seq_len=16, vocab=16, num_kv_pairs=2),
        dict(steps=2, batch_size=2, eval_every=1, eval_batches=1, dim=8, depth=1, heads=1, token_shift=True))})
    from conftest import NoisySoftmax

    import attnkit

    out = tmp_path / "demo"
    with attnkit.registered(NoisySoftmax, name="toy-noisy", family="test", summary="noisy"):
        code, stdout, err = cli("demo", "--attention", "softmax", "toy-noisy", "--out", str(out), "-q")
    assert code == 0, err
    for f in ("README.md", "bench/bench.png", "bench/table.md", "train-mqar/learning_curves.png",
              "train-mqar/table.md", "error/error.png", "error/table.md"):
        assert (out / f).exists(), f
    readme = (out / "README.md").read_text()
    assert "attnkit bench softmax toy-noisy" in readme and "--from-run train-mqar" in readme
    assert str(out) in stdout
