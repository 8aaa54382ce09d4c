"""Measured backend choice: ``attnkit.tuning`` (the cache, the lookup, ``backend="auto"``, ``attnkit tune``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

import pytest
import torch

import attnkit
from attnkit import attention as attention_mod
from attnkit import tuning
from attnkit.errors import InvalidInputError, UsageError


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets its own empty cache directory and a freshly imported tuning hook."""
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv("ATTNKIT_BACKEND", raising=False)
    attention_mod._TUNING.clear()
    real = tuning._default_dir() / "tuning.json"
    before = tuning._stat(real)
    yield tmp_path
    attention_mod._TUNING.clear()
    assert tuning._stat(real) == before, f"a test wrote the user's tuning cache {real}"


class Probe(attnkit.Attention):
    """Records the backend each call ran; ``torch`` is slow, ``broken`` raises."""

    calls: list[str] = []

    def _attend(self, q, k, v, ctx):
        type(self).calls.append(ctx.backend)
        if ctx.backend == "torch":
            time.sleep(0.02)
        if ctx.backend == "broken":
            raise RuntimeError("the broken backend always fails")
        return v * 1.0


PROBE_CAPS = attnkit.Capabilities(backends=("torch", "fastpath"))
FORWARD_ONLY_CAPS = attnkit.Capabilities(backends=("torch", "fastpath"), forward_only_backends=("fastpath",))


@pytest.fixture
def probe():
    Probe.calls = []
    with attnkit.registered(Probe, name="tuning-probe", capabilities=PROBE_CAPS) as spec:
        yield spec


@pytest.fixture
def forward_only_probe():
    Probe.calls = []
    with attnkit.registered(Probe, name="tuning-probe-fo", capabilities=FORWARD_ONLY_CAPS) as spec:
        yield spec


def cache_data(spec, rows, *, version=None, fp=None, torch_field=None):
    """A cache holding ``rows`` ``{(grad, causal, length): winner}`` for ``spec`` on the machine ``fp``."""
    fp = fp or tuning.fingerprint()
    results = [
        {"device": "cpu", "device_name": "", "dtype": "float32", "grad": grad, "causal": causal, "length": length,
         "seconds": {winner: 0.001}, "failed": {}, "winner": winner}
        for (grad, causal, length), winner in rows.items()
    ]
    return {"format": tuning.FORMAT, "machines": {tuning._machine_key(fp): {
        "machine": {k: fp[k] for k in ("arch", "cpu", "cpus")},
        "torch": fp["torch"] if torch_field is None else torch_field,
        "specs": {f"{spec.distribution}:{spec.name}": {
            "name": spec.name, "distribution": spec.distribution,
            "version": spec.version if version is None else version, "results": results}},
    }}}


def lookup(spec, *, needs_grad=False, length=16, causal=None):
    return tuning.tuned_backend(spec, device=torch.device("cpu"), dtype=torch.float32, needs_grad=needs_grad,
                                length=length, causal=causal)


def qkv(length=16, grad=False):
    return [torch.randn(1, 2, length, 8, requires_grad=grad) for _ in range(3)]


# ------------------------------------------------------------------ the cache file
def test_cache_path_follows_env_then_platformdirs_then_home(cache_dir, monkeypatch):
    assert tuning.cache_path() == cache_dir / "tuning.json"
    monkeypatch.delenv(tuning.ENV_CACHE_DIR)
    try:
        import platformdirs
    except ImportError:
        expected = os.path.expanduser("~/.cache/attnkit")
    else:
        expected = platformdirs.user_cache_dir("attnkit")
    tuning._default_dir.cache_clear()
    try:
        assert tuning.cache_path() == tuning.Path(expected) / "tuning.json"
        monkeypatch.setitem(sys.modules, "platformdirs", None)  # not importable
        tuning._default_dir.cache_clear()
        assert tuning.cache_path() == tuning.Path("~/.cache/attnkit/tuning.json").expanduser()
    finally:
        tuning._default_dir.cache_clear()


def test_tune_writes_a_cache_keyed_by_machine_torch_and_version(cache_dir, no_plugins):
    lines = []
    result = tuning.tune(["softmax"], lengths=(16, 32), repeats=1, progress=lines.append, registry=no_plugins)
    path = cache_dir / "tuning.json"
    assert result["path"] == str(path) and path.exists()
    assert any(line.startswith("softmax: cpu float32") for line in lines) and lines[-1] == f"wrote {path}"

    data = json.loads(path.read_text())
    fp = tuning.fingerprint()
    assert data["format"] == tuning.FORMAT
    assert list(data["machines"]) == [result["key"]]
    entry = data["machines"][result["key"]]
    assert entry["machine"] == {"arch": platform.machine(), "cpu": fp["cpu"], "cpus": os.cpu_count()}
    assert entry["torch"] == torch.__version__
    node = platform.node()
    assert len(node) < 4 or node not in path.read_text()  # no hostname
    spec = no_plugins.resolve("softmax")
    sentry = entry["specs"]["attnkit:softmax"]
    assert sentry["version"] == spec.version == attnkit.__version__
    cases = {(r["grad"], r["causal"], r["length"]) for r in sentry["results"]}
    assert cases == {(g, c, n) for g in (False, True) for c in (False, True) for n in (16, 32)}
    for r in sentry["results"]:
        assert set(r["seconds"]) == {"sdpa", "torch"} and all(s > 0 for s in r["seconds"].values())
        assert r["winner"] == min(r["seconds"], key=r["seconds"].get) and r["failed"] == {}
        assert (r["device"], r["dtype"]) == ("cpu", "float32")
    # the lookup returns the measured winner: nearest length on a log scale, causal preferred
    by_case = {(r["grad"], r["causal"], r["length"]): r["winner"] for r in sentry["results"]}
    assert lookup(spec, length=16) == by_case[(False, True, 16)]
    assert lookup(spec, length=1000, needs_grad=True) == by_case[(True, True, 32)]
    assert lookup(spec, length=22, causal=False) == by_case[(False, False, 16)]  # log2(22) is nearer 16 than 32
    assert lookup(spec, length=23, causal=False) == by_case[(False, False, 32)]
    assert tuning.tuned_backend(spec, device="cpu", dtype=torch.float64, needs_grad=False, length=16) is None
    assert tuning.load() == data


def test_tuning_again_merges_and_keeps_other_lengths(cache_dir, no_plugins):
    tuning.tune("softmax", lengths=(16,), repeats=1, progress=None, registry=no_plugins)
    tuning.tune("softmax", lengths=(32,), repeats=1, progress=None, registry=no_plugins)
    entry = next(iter(tuning.load()["machines"].values()))
    assert sorted({r["length"] for r in entry["specs"]["attnkit:softmax"]["results"]}) == [16, 32]


def test_tuned_backend_is_none_without_a_cache(cache_dir, probe):
    assert not (cache_dir / "tuning.json").exists()
    assert lookup(probe) is None
    assert tuning.tuned_backend(None, device="cpu", dtype=torch.float32, needs_grad=False, length=16) is None
    assert tuning.load() == {}
    assert tuning.clear() is False


def test_tuned_backend_returns_the_stored_winner(probe):
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath", (True, True, 16): "torch"}))
    assert lookup(probe) == "fastpath"
    assert lookup(probe, causal=False) == "fastpath"  # only causal measured: used for both modes
    assert lookup(probe, needs_grad=True, length=4096) == "torch"


@pytest.mark.parametrize("change", ["torch", "arch", "cpu", "cpus"])
def test_an_entry_for_another_machine_or_torch_version_is_ignored(probe, change):
    fp = dict(tuning.fingerprint())
    fp[change] = 12345 if change == "cpus" else "something-else"
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}, fp=fp))
    assert lookup(probe) is None
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}))
    assert lookup(probe) == "fastpath"


def test_a_cache_read_under_another_torch_version_is_ignored(probe):
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}))
    assert lookup(probe) == "fastpath"
    with pytest.MonkeyPatch.context() as mp:  # not the fixture's: undoing it would drop ATTNKIT_CACHE_DIR
        mp.setattr(torch, "__version__", "0.0.1")
        assert lookup(probe) is None
    assert lookup(probe) == "fastpath"
    # the right key but a mismatching torch field: ignored as well
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}, torch_field="0.0.1"))
    assert lookup(probe) is None


def test_an_entry_for_another_plugin_version_is_ignored(probe):
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}, version="9.9"))
    assert lookup(probe) is None
    assert tuning.describe_lines(probe)[0].startswith("stale: measured with local '9.9'")


def test_a_corrupt_cache_warns_once_and_is_ignored(cache_dir, probe):
    (cache_dir / "tuning.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring the tuning cache"):
        assert lookup(probe) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup(probe) is None
        assert tuning.load() == {}
    m = attnkit.build("tuning-probe")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(*qkv())
    assert Probe.calls == ["torch"]


@pytest.mark.parametrize("content", [
    "[]",
    json.dumps({"format": 999, "machines": {}}),
    "MALFORMED",
])
def test_a_malformed_cache_warns_and_is_ignored(cache_dir, probe, content):
    if content == "MALFORMED":
        data = cache_data(probe, {(False, True, 16): "fastpath"})
        next(iter(data["machines"].values()))["specs"] = ["not", "a", "dict"]
        content = json.dumps(data)
    (cache_dir / "tuning.json").write_text(content)
    with pytest.warns(RuntimeWarning, match="ignoring the tuning cache"):
        assert lookup(probe) is None


def test_tune_replaces_a_corrupt_cache(cache_dir, no_plugins):
    (cache_dir / "tuning.json").write_text("garbage")
    with pytest.warns(RuntimeWarning):
        tuning.tune("softmax", lengths=(16,), repeats=1, progress=None, registry=no_plugins)
    assert "attnkit:softmax" in next(iter(tuning.load()["machines"].values()))["specs"]


def test_generation_changes_on_write_clear_and_another_process(cache_dir, probe, monkeypatch):
    g0 = tuning.generation()
    assert tuning.generation() == g0  # stable while nothing changes
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}))
    g1 = tuning.generation()
    assert g1 != g0
    # another process replaces the file: noticed at the next look (at most once a second; now at once)
    monkeypatch.setattr(tuning, "RESTAT_SECONDS", 0.0)
    other = cache_dir / "other.json"
    other.write_text(json.dumps(cache_data(probe, {(False, True, 16): "torch"})))
    os.replace(other, cache_dir / "tuning.json")
    g2 = tuning.generation()
    assert g2 != g1 and lookup(probe) == "torch"
    assert tuning.clear() is True and not (cache_dir / "tuning.json").exists()
    assert tuning.generation() != g2 and lookup(probe) is None


# ------------------------------------------------------------------ backend="auto"
def test_auto_runs_the_tuned_backend(probe):
    m = attnkit.build("tuning-probe")
    m(*qkv())
    assert Probe.calls == ["torch"]  # the static choice: the first offered backend
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath", (False, False, 16): "fastpath"}))
    m(*qkv())
    m(*qkv(), causal=True)
    assert Probe.calls[1:] == ["fastpath", "fastpath"]
    forced = attnkit.build("tuning-probe", backend="torch")
    forced(*qkv())
    assert Probe.calls[-1] == "torch"  # a forced backend wins over measurements
    tuning.clear()
    m(*qkv())
    assert Probe.calls[-1] == "torch"


def test_the_backend_env_variable_wins_over_measurements(probe, monkeypatch):
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}))
    monkeypatch.setenv("ATTNKIT_BACKEND", "torch")
    attnkit.build("tuning-probe")(*qkv())
    assert Probe.calls == ["torch"]


def test_a_forward_only_tuned_backend_is_not_used_when_grads_are_needed(forward_only_probe):
    spec = forward_only_probe
    tuning._write(cache_data(spec, {(False, True, 16): "fastpath", (True, True, 16): "fastpath"}))
    assert lookup(spec) == "fastpath"
    assert lookup(spec, needs_grad=True) is None
    m = attnkit.build("tuning-probe-fo")
    m(*qkv())
    out = m(*qkv(grad=True))
    out.sum().backward()
    with torch.no_grad():
        m(*qkv(grad=True))
    assert Probe.calls == ["fastpath", "torch", "fastpath"]


def test_describe_lines_show_the_measured_figures(probe):
    assert tuning.describe_lines(probe) == ["none on this machine (run `attnkit tune tuning-probe`)"]
    tuning._write(cache_data(probe, {(False, True, 16): "fastpath"}))
    lines = tuning.describe_lines("tuning-probe")
    assert lines[0] == f"cache: {tuning.cache_path()}" and len(lines) == 2
    assert lines[1] == "cpu float32 forward causal     L=16      fastpath 1.00 ms  -> fastpath"


def test_attnkit_describe_and_tune_through_the_command_line(cache_dir, capsys):
    from attnkit.cli import main

    assert main(["tune", "softmax", "--lengths", "16", "--repeats", "1"]) == 0
    assert (cache_dir / "tuning.json").exists()
    capsys.readouterr()
    assert main(["describe", "softmax"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {cache_dir / 'tuning.json'}" in out and "L=16" in out
    assert main(["tune", "softmax", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


# ------------------------------------------------------------------ measuring
def test_tune_times_each_runnable_backend_and_records_failures_and_limits(cache_dir):
    caps = attnkit.Capabilities(backends=("torch", "fastpath", "broken"), forward_only_backends=("fastpath",),
                                max_length=16, noncausal=False)
    Probe.calls = []
    with attnkit.registered(Probe, name="tuning-probe-all", capabilities=caps) as spec:
        result = tuning.tune(["tuning-probe-all"], lengths=(16, 32), repeats=1, progress=None)
        sentry = result["specs"]["local:tuning-probe-all"]
        assert sentry["skipped"] == [{"length": 32, "reason": "max_length 16"}]
        by_grad = {r["grad"]: r for r in sentry["results"]}
        assert set(by_grad) == {False, True} and all(r["causal"] and r["length"] == 16 for r in sentry["results"])
        fwd, bwd = by_grad[False], by_grad[True]
        assert set(fwd["seconds"]) == {"torch", "fastpath"}  # broken failed, fastpath forward-only
        assert set(bwd["seconds"]) == {"torch"} and bwd["winner"] == "torch"
        for r in (fwd, bwd):
            assert "RuntimeError: the broken backend always fails" in r["failed"]["broken"]
            assert r["seconds"]["torch"] >= 0.02  # the probe sleeps on torch
            assert r["winner"] == min(r["seconds"], key=r["seconds"].get)
        # one warm-up call, then the repeats, per backend and case; the backward run only where it can
        assert Probe.calls.count("fastpath") == 2 and Probe.calls.count("torch") == 4
        stored = next(iter(tuning.load()["machines"].values()))["specs"]["local:tuning-probe-all"]
        assert stored["results"] == sentry["results"]
        assert lookup(spec, needs_grad=True) == "torch"


@pytest.mark.parametrize("kwargs", [
    {"lengths": (0,)}, {"lengths": (2 ** 20 + 1,)}, {"lengths": ()}, {"lengths": ("16",)}, {"repeats": 0},
    {"repeats": 101}, {"dtype": "int8"}, {"dtype": torch.int32}, {"device": "nonsense"}, {"heads": 0},
])
def test_tune_refuses_bad_arguments(kwargs, no_plugins):
    with pytest.raises(InvalidInputError):
        tuning.tune("softmax", progress=None, registry=no_plugins, **kwargs)
    assert tuning.load() == {}


# ------------------------------------------------------------------ attnkit tune
def parse(argv):
    parser = argparse.ArgumentParser(prog="attnkit tune")
    tuning.configure_tune(parser)
    return parser.parse_args(argv)


def test_run_tune_measures_softmax_and_writes_the_cache(cache_dir, no_plugins, capsys):
    code = tuning.run_tune(parse(["softmax", "--lengths", "16,32", "--repeats", "1"]), no_plugins)
    out = capsys.readouterr().out
    assert code == 0
    assert (cache_dir / "tuning.json").exists() and f"wrote {cache_dir / 'tuning.json'}" in out
    entry = next(iter(tuning.load()["machines"].values()))
    assert {r["length"] for r in entry["specs"]["attnkit:softmax"]["results"]} == {16, 32}

    assert tuning.run_tune(parse(["--show"]), no_plugins) == 0
    out = capsys.readouterr().out
    assert f"tuning cache: {cache_dir / 'tuning.json'}" in out and "attnkit:softmax" in out and "L=32" in out

    assert tuning.run_tune(parse(["--clear"]), no_plugins) == 0
    assert "removed" in capsys.readouterr().out and not (cache_dir / "tuning.json").exists()
    assert tuning.run_tune(parse(["--clear", "--show"]), no_plugins) == 0
    assert "(none)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["--lengths", "0"], ["--lengths", str(2 ** 20 + 1)], ["--lengths", "16,x"], ["--lengths", ","],
    ["--repeats", "0"], ["--repeats", "101"], ["--repeats", "two"],
    ["--dtype", "int8"], ["--device", "nonsense"],
])
def test_run_tune_refuses_bad_values(argv, no_plugins):
    with pytest.raises(UsageError):
        tuning.run_tune(parse(["softmax", *argv]), no_plugins)
    assert tuning.load() == {}


def test_run_tune_refuses_an_unknown_name_before_measuring(no_plugins):
    with pytest.raises(attnkit.UnknownAttentionError):
        tuning.run_tune(parse(["sofmax", "--lengths", "16", "--repeats", "1"]), no_plugins)
    assert tuning.load() == {}


class AlwaysFails(attnkit.Attention):
    """Fails on every backend."""

    def _attend(self, q, k, v, ctx):
        raise RuntimeError(f"{ctx.backend} cannot run")


def test_run_tune_fails_when_no_backend_of_a_named_mechanism_ran(capsys):
    with attnkit.registered(AlwaysFails, name="tuning-always-fails"):
        code = tuning.run_tune(parse(["tuning-always-fails", "--lengths", "16", "--repeats", "1"]))
    out = capsys.readouterr().out
    assert code == 1
    assert "torch failed: RuntimeError: torch cannot run" in out and "no backend ran" in out
    stored = next(iter(tuning.load()["machines"].values()))["specs"]["local:tuning-always-fails"]
    assert all(r["winner"] is None for r in stored["results"])
