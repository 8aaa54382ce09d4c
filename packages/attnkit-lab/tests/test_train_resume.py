"""Resumable training: SIGKILL a run mid-way, resume it, end with the uninterrupted run's parameters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnkit.errors import UsageError
from attnkit_lab.checkpoint import FORMAT, atomic_save, load_state

STEPS, EVERY = 120, 5
# dropout > 0 makes the run consume the global RNG every step: the resumed run must restore it exactly
ARGS = ["train", "copy", "-a", "softmax", "--steps", str(STEPS), "--dim", "16", "--depth", "1", "--heads", "2",
        "--batch-size", "8", "--seq-len", "32", "--eval-every", "20", "--eval-batches", "1", "--dropout", "0.1",
        "--warmup", "10", "--quiet", "--threads", "1", "--seed", "3"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "attnkit", *args]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def final(out: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    ckpt = torch.load(out / "softmax" / "checkpoint.pt", weights_only=False)
    runs = json.loads((out / "results.json").read_text())["runs"]
    return ckpt["state_dict"], runs[0]["curve"]


def test_a_killed_run_resumes_to_the_uninterrupted_parameters(tmp_path):
    ckpts = tmp_path / "ckpt"
    proc = subprocess.Popen(cli(*ARGS, "--checkpoint-every", str(EVERY), "--checkpoint-dir", str(ckpts),
                                "--out", str(tmp_path / "killed")), env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = ckpts / "softmax" / "state.pt"
    deadline = time.monotonic() + 240
    killed_at = None
    while time.monotonic() < deadline and proc.poll() is None:
        if state.exists():
            step = torch.load(state, weights_only=False)["step"]  # readable at any moment: atomic writes
            if step >= 2 * EVERY:
                proc.send_signal(signal.SIGKILL)
                killed_at = step
                break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert killed_at is not None and proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    saved = torch.load(state, weights_only=False)["step"]
    assert saved % EVERY == 0 and 2 * EVERY <= saved < STEPS  # killed mid-way, the last complete checkpoint kept
    assert not (tmp_path / "killed").exists()  # a killed run publishes no results
    # a kill during a write may leave a hidden temporary, never a half-written state.pt
    assert all(p.name.startswith(".state.pt.") for p in state.parent.iterdir() if p.name != "state.pt")

    resumed = subprocess.run(cli(*ARGS, "--resume", str(ckpts), "--out", str(tmp_path / "resumed")), env=env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = subprocess.run(cli(*ARGS, "--out", str(tmp_path / "whole")), env=env(), capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr

    got, got_curve = final(tmp_path / "resumed")
    want, want_curve = final(tmp_path / "whole")
    assert got.keys() == want.keys()
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, atol=0, rtol=0, msg=f"parameter {name} after resuming")
    # and the learning curves agree point by point (losses and accuracies, not timings)
    keys = ("step", "train_loss", "eval_loss", "eval_accuracy")
    assert [{k: p[k] for k in keys} for p in got_curve] == [{k: p[k] for k in keys} for p in want_curve]
    assert torch.load(state, weights_only=False)["step"] == STEPS  # the resumed run kept checkpointing
    assert [p.name for p in state.parent.iterdir()] == ["state.pt"]  # and removed any stale temporary


def test_resuming_with_other_settings_is_refused(tmp_path):
    ckpts = tmp_path / "ckpt"
    short = [a if a != str(STEPS) else "10" for a in ARGS]
    res = subprocess.run(cli(*short, "--checkpoint-every", "5", "--checkpoint-dir", str(ckpts),
                             "--out", str(tmp_path / "a")), env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    other = [a if a != "16" else "8" for a in short]  # --dim 8
    res = subprocess.run(cli(*other, "--resume", str(ckpts), "--out", str(tmp_path / "b")), env=env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "--resume" in res.stderr and "settings" in res.stderr
    res = subprocess.run(cli(*short, "--resume", str(tmp_path / "missing"), "--out", str(tmp_path / "c")),
                         env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "--resume" in res.stderr


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    atomic_save({"format": FORMAT, "step": 5}, path)

    def broken_save(obj, f):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"format": FORMAT, "step": 10}, path)
    monkeypatch.undo()
    assert load_state(path, expect={})["step"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]
    with pytest.raises(UsageError, match="another step"):
        load_state(path, expect={"step": 6})


def test_nproc_2_trains_like_one_process_on_the_global_batch(tmp_path):
    """``--nproc 2 --batch-size 4`` (torch.distributed.run, gloo) equals ``--batch-size 8`` in one process."""
    base = ["train", "copy", "-a", "softmax", "--steps", "4", "--dim", "16", "--depth", "1", "--heads", "2",
            "--seq-len", "32", "--eval-every", "2", "--eval-batches", "1", "--quiet", "--threads", "1"]
    two = subprocess.run(cli(*base, "--batch-size", "4", "--nproc", "2", "--out", str(tmp_path / "two")), env=env(),
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout + two.stderr
    one = subprocess.run(cli(*base, "--batch-size", "8", "--out", str(tmp_path / "one")), env=env(),
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    got, got_curve = final(tmp_path / "two")
    want, want_curve = final(tmp_path / "one")
    for name, p in want.items():  # float32, gradients averaged by all-reduce: equal up to rounding
        # the key projection's bias has zero gradient in exact arithmetic (softmax ignores a shift shared by
        # all keys): AdamW turns its rounding noise into steps of about lr, so it is held to lr-size only
        atol = 1e-3 if name.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(got[name], p, atol=atol, rtol=1e-4, msg=f"parameter {name} with --nproc 2")
    for a, b in zip(got_curve, want_curve, strict=True):
        assert a["step"] == b["step"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6)
    payload = json.loads((tmp_path / "two" / "results.json").read_text())
    assert payload["processes"] == 2 and payload["settings"]["batch_size"] == 4
    assert "2 processes, global batch 8" in two.stdout
    assert two.stdout.count("results:") == 1  # only rank 0 publishes
