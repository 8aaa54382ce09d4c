"""Result directories are published atomically; tables and JSON are plain."""

from __future__ import annotations

import json
import math
import os

import pytest

from attnkit.errors import UsageError
from attnkit_lab.progress import Progress
from attnkit_lab.results import RunDir, format_table, write_json


def test_rundir_commit_and_abort(tmp_path):
    dest = tmp_path / "out"
    with RunDir(dest) as rd:
        rd.write_text("a.txt", "hello")
        assert not dest.exists()                          # nothing visible until complete
    assert (dest / "a.txt").read_text() == "hello"
    with pytest.raises(RuntimeError):
        with RunDir(tmp_path / "broken") as rd:
            rd.write_text("half.txt", "x")
            raise RuntimeError("boom")
    assert not (tmp_path / "broken").exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_rundir_refuses_existing_unless_forced(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(UsageError, match="--force"):
        RunDir(dest).open()
    with RunDir(dest, force=True) as rd:
        rd.write_text("new.txt", "new")
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        RunDir(tmp_path / "file").open()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_rundir_unwritable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(UsageError, match="not writable"):
            RunDir(ro / "out").open()
    finally:
        ro.chmod(0o700)


def test_rundir_unwritable_parent_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="not writable"):
        RunDir(tmp_path / "f" / "out").open()


def test_json_and_table(tmp_path):
    p = write_json(tmp_path / "r.json", {"x": math.nan, "y": (1, 2.5), "z": math.inf})
    assert json.loads(p.read_text()) == {"x": None, "y": [1, 2.5], "z": None}
    t = format_table([["a", 1.23456, None], ["bb", 20000.0, 3]], ["name", "v", "w"])
    lines = t.splitlines()
    assert lines[0].startswith("| name") and "—" in lines[2] and "2e+04" in lines[3]


def test_progress_draws_nothing_off_a_terminal_or_when_quiet():
    import io

    buf = io.StringIO()                                   # not a TTY: CI logs, pipes
    with Progress(20, "x", stream=buf) as p:
        for _ in range(20):
            p.update(1, loss=0.5)
    assert buf.getvalue() == "" and p.n == 20
    tty = _Tty()
    with Progress(5, "y", stream=tty, enabled=False) as p:   # --quiet
        p.update(5)
    assert tty.getvalue() == ""


class _Tty(__import__("io").StringIO):
    def isatty(self):
        return True


def test_result_files_get_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        with RunDir(tmp_path / "out") as rd:
            rd.write_text("a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "out" / "a.txt").stat().st_mode & 0o777 == 0o644


def test_progress_tty_redraws_in_place_with_postfix():
    buf = _Tty()
    with Progress(3, "z", stream=buf) as p:
        p.set_postfix(attn="performer")                         # drawn at once
        for _ in range(3):
            p.update(1, loss=0.25)                              # replaces the postfix
    text = buf.getvalue()
    assert text.count("\r") >= 2 and text.endswith("\n")        # tqdm redraws in place, then leaves the bar
    assert "attn=performer" in text
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("z: 100%") and "3/3" in last and "loss=0.25" in last and "attn=" not in last
