"""``attnkit bench`` on tiny sizes: records, refusals, OOM, timeouts, outputs."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import Attention
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


class _Counting(Attention):
    """Exact attention that logs every call: (L, whether it ran inside a timed call)."""

    log: list[tuple[int, bool]] = []

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        _Counting.log.append((q.shape[-2], _timing[0]))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


_timing = [False]


def test_bench_warms_up_every_pair_before_timing_it(cli, tmp_path, monkeypatch):
    from attnkit_lab import bench

    real = bench.time_call

    def timed(fn, device):
        _timing[0] = True
        try:
            return real(fn, device)
        finally:
            _timing[0] = False

    monkeypatch.setattr(bench, "time_call", timed)
    monkeypatch.setattr(_Counting, "log", [])
    out = tmp_path / "b"
    with attnkit.registered(_Counting, name="toy-counting", family="test", summary="counts calls", exact=True):
        code, stdout, err = cli("bench", "toy-counting", "softmax", "--lengths", "16,32", "--heads", "1",
                                "--head-dim", "4", "--warmup", "2", "--repeats", "3", "--modes", "fwd",
                                "--no-memory", "--out", str(out), "-q")
    assert code == 0, err
    for L in (16, 32):
        calls = [t for n, t in _Counting.log if n == L]
        # first call (timed on its own), 2 untimed warm-up calls, then the 3 timed rounds
        assert calls == [True, False, False, True, True, True], (L, calls)
    _, rec = _records(out)
    for label in ("sdpa", "toy-counting", "softmax"):
        for L in (16, 32):
            r = rec[(label, L, "fwd")]
            assert r["status"] == "ok" and r["warmup_calls"] == 2 and r["repeats"] == 3
            assert r["min_s"] <= r["q1_s"] <= r["median_s"] <= r["q3_s"] <= r["max_s"]
            assert r["iqr_s"] == pytest.approx(r["q3_s"] - r["q1_s"])
            assert r["spread"] == pytest.approx(r["iqr_s"] / r["median_s"])
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert {"min_s", "max_s", "iqr_s", "spread", "warmup_calls"} <= set(header)
    table = (out / "table.md").read_text()
    assert "interquartile range" in table and "%" in table.split("## Forward: time")[1].split("##")[0]


class _Short(Attention):
    """Exact attention whose limits say max_length=8 (and which records the lengths it was called with)."""

    seen: list[int] = []

    @property
    def limits(self):
        from attnkit import attention

        cls = getattr(attention, "Limits", None)
        if cls is None:                       # a core without contract 2: any object with the fields
            return types.SimpleNamespace(max_length=8, equal_length=True, length_multiple=None)
        return cls(max_length=8, equal_length=True)

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        _Short.seen.append(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_bench_skips_lengths_beyond_limits(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(_Short, "seen", [])
    out = tmp_path / "b"
    with attnkit.registered(_Short, name="toy-short", family="test", summary="max_length 8", exact=True):
        code, stdout, err = cli("bench", "toy-short", "--lengths", "4,8,16,32", "--heads", "1", "--head-dim", "4",
                                "--repeats", "1", "--modes", "fwd,fwdbwd", "--no-memory", "--out", str(out), "-q")
    assert code == 0, err
    _, rec = _records(out)
    for mode in ("fwd", "fwdbwd"):
        assert rec[("toy-short", 4, mode)]["status"] == rec[("toy-short", 8, mode)]["status"] == "ok"
        for L in (16, 32):
            r = rec[("toy-short", L, mode)]
            assert r["status"] == "skipped" and r["note"] == "max_length 8"
            assert rec[("sdpa", L, mode)]["status"] == "ok"
    assert max(_Short.seen) == 8                               # never called beyond its limit
    assert "skipped: max_length 8" in (out / "table.md").read_text()
    assert "skipped: max_length 8" in stdout


def test_bench_limit_reason_without_limits():
    from attnkit_lab.bench import limit_reason

    assert limit_reason(None, 10 ** 6) is None
    assert limit_reason(torch.nn.Linear(2, 2), 10 ** 6) is None               # no `limits` attribute
    obj = types.SimpleNamespace(limits=types.SimpleNamespace(max_length=None, length_multiple=32))
    assert limit_reason(obj, 48) == "length_multiple 32" and limit_reason(obj, 64) is None


def test_bench_limit_reason_asks_why_not():
    """The reason is the implementation's own ``limits.why_not(L, L)``, whatever limit it applies."""
    from attnkit_lab.bench import limit_reason

    asked = []

    class Custom:
        def why_not(self, L, S):
            asked.append((L, S))
            return "a power of two" if L & (L - 1) else None

    obj = types.SimpleNamespace(limits=Custom())
    assert limit_reason(obj, 48) == "a power of two" and limit_reason(obj, 64) is None
    assert asked == [(48, 48), (64, 64)]
    lim = types.SimpleNamespace(limits=attnkit.Limits(max_length=512, length_multiple=32))
    assert limit_reason(lim, 1024) == "max_length 512"
    assert limit_reason(lim, 48) == attnkit.Limits(length_multiple=32).why_not(48, 48)
    assert limit_reason(lim, 64) is None


def test_bench_inputs_larger_than_memory_are_not_allocated(cli, tmp_path, monkeypatch):
    from attnkit_lab import bench

    # q, k, v, g in float32 at B=1, H=1, D=4: 1 KiB at L=16, 4 KiB at L=64
    monkeypatch.setattr(bench, "available_memory", lambda device: 2048)
    out = tmp_path / "b"
    code, _, err = cli("bench", "softmax", "--lengths", "16,64,128", "--heads", "1", "--head-dim", "4",
                       "--repeats", "1", "--modes", "fwd", "--no-memory", "--out", str(out), "-q")
    assert code == 0, err
    _, rec = _records(out)
    assert rec[("sdpa", 16, "fwd")]["status"] == rec[("softmax", 16, "fwd")]["status"] == "ok"
    for label in ("sdpa", "softmax"):
        r = rec[(label, 64, "fwd")]
        assert r["status"] == "oom" and "need 4.0 KiB, more than the 2.0 KiB available" in r["note"]
        assert rec[(label, 128, "fwd")]["status"] == "skipped"
        assert "inputs could not be allocated at L=64" in rec[(label, 128, "fwd")]["note"]
