"""Ctrl-C stops a command at once, keeps the results so far, says where they are and exits 130.

Inside a numba kernel Ctrl-C reaches Python as a SystemError chained to the
KeyboardInterrupt; it must be treated as the interrupt it is, not recorded as
the mechanism's failure.
"""

from __future__ import annotations

import json

import pytest

from attnkit_lab.interrupts import is_interrupt

KINDS = ["keyboard", "systemerror", "systemerror-context"]


def _systemerror(chain: str) -> SystemError:
    from conftest import raise_interrupt

    try:
        raise_interrupt(chain)
    except SystemError as e:
        return e
    raise AssertionError("no SystemError raised")


def test_is_interrupt():
    assert is_interrupt(KeyboardInterrupt())
    assert is_interrupt(_systemerror("systemerror"))             # __cause__
    assert is_interrupt(_systemerror("systemerror-context"))     # __context__
    outer = SystemError("outer")
    outer.__context__ = _systemerror("systemerror")
    assert is_interrupt(outer)                                    # deeper in the chain
    assert not is_interrupt(SystemError("a real SystemError"))
    assert not is_interrupt(RuntimeError("boom"))
    assert not is_interrupt(None)
    loop = SystemError("loop")
    loop.__context__ = loop
    assert not is_interrupt(loop)


def _assert_published(out, err, *, code):
    assert code == 130, err
    assert "interrupted; results so far:" in err and str(out) in err and "Traceback" not in err
    assert out.is_dir() and not [p for p in out.parent.iterdir() if ".partial-" in p.name]
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_train_stops_at_an_interrupt(cli, tmp_path, toy_mechanisms, interrupting, kind):
    fake = interrupting(kind, lambda q: fake.calls >= 3)     # in the second training step
    out = tmp_path / "t"
    code, _, err = cli("train", "mqar", "--attention", "softmax", "toy-interrupt", "softmax@backend=torch",
                       "--seq-len", "16", "--vocab", "16", "--num-kv-pairs", "2", "--steps", "4", "--eval-every", "1",
                       "--eval-batches", "1", "--batch-size", "2", "--dim", "8", "--heads", "1", "--depth", "1",
                       "--out", str(out), "-q")
    data = _assert_published(out, err, code=code)
    assert data["interrupted"] is True
    runs = {r["label"]: r for r in data["runs"]}
    # the run stopped at once: the third attention never started
    assert list(runs) == ["softmax", "toy-interrupt"]
    assert runs["softmax"]["status"] == "ok" and (out / runs["softmax"]["checkpoint"]).exists()
    bad = runs["toy-interrupt"]
    assert bad["status"] == "interrupted" and "step 1" in bad["note"]
    assert [p["step"] for p in bad["curve"]] == [1]               # its history so far is kept
    assert "Interrupted" in (out / "table.md").read_text()
    assert (out / "curves.csv").exists() and (out / "results.csv").exists()


@pytest.mark.parametrize("kind", ["keyboard", "systemerror"])
def test_bench_stops_at_an_interrupt(cli, tmp_path, toy_mechanisms, interrupting, kind):
    interrupting(kind, lambda q: q.shape[-2] == 32)
    out = tmp_path / "b"
    code, _, err = cli("bench", "toy-interrupt", "softmax", "--lengths", "16,32,64", "--heads", "1", "--head-dim", "4",
                       "--repeats", "1", "--modes", "fwd", "--no-memory", "--out", str(out), "-q")
    data = _assert_published(out, err, code=code)
    assert data["interrupted"] is True
    got = {(r["label"], r["length"]): r["status"] for r in data["records"]}
    # L=16 measured for everyone; nothing at or after the interrupt, not even the other mechanism
    assert got == {("sdpa", 16): "ok", ("toy-interrupt", 16): "ok", ("softmax", 16): "ok"}
    assert "Interrupted" in (out / "table.md").read_text() and not (out / "bench.png").exists()


@pytest.mark.parametrize("kind", ["keyboard", "systemerror-context"])
def test_error_stops_at_an_interrupt(cli, tmp_path, toy_mechanisms, interrupting, kind):
    interrupting(kind, lambda q: q.shape[-2] == 32)
    out = tmp_path / "e"
    code, _, err = cli("error", "toy-interrupt", "toy-noisy", "--lengths", "16,32", "--budgets", "4",
                       "--budget-length", "16", "--temperatures", "1", "--trials", "1", "--heads", "1",
                       "--head-dim", "4", "--out", str(out), "-q")
    data = _assert_published(out, err, code=code)
    assert data["interrupted"] is True
    assert [(r["label"], r["length"], r["status"]) for r in data["records"]] == [("toy-interrupt", 16, "ok")]


@pytest.mark.parametrize("kind", ["keyboard", "systemerror"])
def test_demo_stops_at_an_interrupt(cli, tmp_path, toy_mechanisms, interrupting, tiny_demo, kind):
    interrupting(kind, lambda q: q.shape[-2] == 16)           # the tiny mqar length: bench runs 32 and 64
    out = tmp_path / "d"
    code, _, err = cli("demo", "--attention", "softmax", "toy-interrupt", "--out", str(out), "-q")
    assert code == 130, err
    assert "interrupted; results so far:" in err and str(out) in err and "Traceback" not in err
    readme = (out / "README.md").read_text()
    assert "Interrupted" in readme and "train mqar" in readme and "## Bench" in readme
    bench = json.loads((out / "bench" / "results.json").read_text())
    assert bench["interrupted"] is False and (out / "bench" / "bench.png").exists()
    train = json.loads((out / "train-mqar" / "results.json").read_text())
    assert train["interrupted"] is True
    assert [r["status"] for r in train["runs"]] == ["ok", "interrupted"]
    assert not (out / "error").exists()


def test_interrupt_at_the_first_call(cli, tmp_path, toy_mechanisms, interrupting):
    interrupting("systemerror", lambda q: True)
    out = tmp_path / "b"
    # the first call of the first mechanism: nothing was measured
    code, _, err = cli("bench", "toy-interrupt", "--lengths", "16", "--heads", "1", "--head-dim", "4",
                       "--repeats", "1", "--modes", "fwd", "--no-memory", "--out", str(out), "-q")
    assert code == 130 and "Traceback" not in err
    # bench writes its (empty) tables: the directory says it was interrupted
    data = json.loads((out / "results.json").read_text())
    assert data["interrupted"] is True and data["records"] == []
