"""Data-parallel training: ``--nproc 2`` (torch.distributed.run, gloo) against one process on the global batch.

Apart from ``test_train_resume.py``, whose subprocess runs take as long: the test runner spreads test modules
over its workers (``--dist loadfile``), so the two files run side by side.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from _runs import cli, env, final


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
