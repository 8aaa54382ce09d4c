"""Resumable training: SIGKILL a run mid-way, resume it, end with the uninterrupted run's parameters."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch
from _runs import cli, env, final

from attnkit.errors import UsageError
from attnkit_lab.checkpoint import FORMAT, atomic_save, load_state

STEPS, EVERY = 120, 5
# dropout > 0 makes the run consume the global RNG every step: the resumed run must restore it exactly
ARGS = ["train", "copy", "-a", "softmax", "--steps", str(STEPS), "--dim", "16", "--depth", "1", "--heads", "2",
        "--batch-size", "8", "--seq-len", "32", "--eval-every", "20", "--eval-batches", "1", "--dropout", "0.1",
        "--warmup", "10", "--quiet", "--threads", "1", "--seed", "3"]


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
