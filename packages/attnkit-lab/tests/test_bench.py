"""``attnkit bench`` on tiny sizes: records, refusals, OOM, timeouts, outputs."""

from __future__ import annotations

import json

import pytest

from attnkit_lab.bench import crossover


def _records(out):
    data = json.loads((out / "results.json").read_text())
    return data, {(r["label"], r["length"], r["mode"]): r for r in data["records"]}


def test_bench_softmax_against_sdpa(cli, tmp_path):
    out = tmp_path / "b"
    code, stdout, err = cli("bench", "softmax", "--lengths", "16,32", "--heads", "2", "--head-dim", "8",
                            "--repeats", "2", "--out", str(out), "--quiet")
    assert code == 0, err
    for f in ("results.json", "results.csv", "table.md", "bench.png"):
        assert (out / f).exists(), f
    data, rec = _records(out)
    for L in (16, 32):
        for mode in ("fwd", "fwdbwd"):
            for label in ("sdpa", "softmax"):
                r = rec[(label, L, mode)]
                assert r["status"] == "ok" and r["median_s"] > 0 and r["repeats"] == 2
                assert r["peak_bytes"] >= 0 and r["first_call_s"] > 0
            assert rec[("softmax", L, mode)]["time_ratio"] > 0
    assert "softmax" in data["crossover"] and "Crossover" in stdout and str(out) in stdout
    assert data["environment"]["torch"] and data["settings"]["lengths"] == [16, 32]


def test_bench_records_refusals_oom_and_timeouts(cli, tmp_path, toy_mechanisms):
    out = tmp_path / "b"
    code, stdout, err = cli("bench", "toy-even", "toy-hungry", "toy-slow", "toy-noncausal", "toy-compiles", "--causal",
                            "--lengths", "16,32,64,128", "--heads", "1", "--head-dim", "4", "--repeats", "1",
                            "--time-limit", "0.1", "--modes", "fwd", "--no-memory", "--out", str(out), "-q")
    assert code == 0, err
    _, rec = _records(out)
    # a length the mechanism cannot take is skipped, and the sweep goes on
    assert rec[("toy-even", 16, "fwd")]["status"] == "skipped"
    assert "multiple of 32" in rec[("toy-even", 16, "fwd")]["note"]
    assert rec[("toy-even", 32, "fwd")]["status"] == "ok"
    assert rec[("toy-even", 128, "fwd")]["status"] == "ok"
    # out of memory is recorded, and longer lengths are not tried
    assert rec[("toy-hungry", 32, "fwd")]["status"] == "ok"
    assert rec[("toy-hungry", 64, "fwd")]["status"] == "oom"
    assert rec[("toy-hungry", 128, "fwd")]["status"] == "skipped"
    assert "out of memory at L=64" in rec[("toy-hungry", 128, "fwd")]["note"]
    # too slow: timeout, then not tried
    slow = [rec[("toy-slow", L, "fwd")]["status"] for L in (16, 32, 64, 128)]
    assert slow[0] == "ok" and "timeout" in slow[:3]        # 10 ms, 40 ms, 160 ms vs a 100 ms limit
    assert slow[slow.index("timeout") + 1:] == ["skipped"] * (3 - slow.index("timeout"))
    # a slow first call (compilation) is reported, not a timeout
    assert rec[("toy-compiles", 16, "fwd")]["status"] == "ok"
    assert rec[("toy-compiles", 16, "fwd")]["first_call_s"] >= 0.3
    # a capability the mechanism lacks: skipped with the reason
    assert rec[("toy-noncausal", 16, "fwd")]["status"] == "skipped"
    assert "causal" in rec[("toy-noncausal", 16, "fwd")]["note"]
    assert "Not measured" in stdout


def test_bench_unknown_name_suggests(cli, tmp_path):
    code, _, err = cli("bench", "softmx", "--out", str(tmp_path / "x"))
    assert code == 2 and "did you mean 'softmax'" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, msg", [
    (["--lengths", "12,abc"], "--lengths"),
    (["--modes", "back"], "--modes"),
    (["--repeats", "0"], "--repeats"),
])
def test_bench_bad_options(cli, tmp_path, args, msg):
    code, _, err = cli("bench", "softmax", *args, "--out", str(tmp_path / "x"), "-q")
    assert code == 2 and msg in err
    assert not list(tmp_path.iterdir())                   # nothing left behind


def test_bench_bad_option_of_a_mechanism(cli, tmp_path):
    code, _, err = cli("bench", "softmax@num_feature=3", "--out", str(tmp_path / "x"))
    assert code == 2 and "has no option 'num_feature'" in err


def test_crossover():
    def pts(*rs):
        return [(256 * 2 ** i, r, r < 1) for i, r in enumerate(rs)]

    assert crossover(pts(2.0, 1.2, 0.5, 0.3))["length"] == 1024
    est = crossover(pts(2.0, 0.5))["estimate"]
    assert 256 < est < 512
    assert crossover(pts(0.5, 0.2))["text"].startswith("≤ 256")
    assert crossover(pts(3.0, 2.0))["length"] is None
    assert crossover(pts(0.5, 2.0))["length"] is None          # slower again at the end
    assert crossover([])["text"] == "n/a"
    # a ratio below 1 within the noise is a tie, not a win
    tie = crossover([(256, 0.97, False), (512, 0.98, False), (1024, 0.5, True)])
    assert tie["length"] == 1024 and tie["estimate"] is None and "tie" in tie["text"]
