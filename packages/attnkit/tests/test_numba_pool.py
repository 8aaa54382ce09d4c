"""``attnkit.numba_pool`` is what plugins' numba kernels share; the core itself never imports numba."""

from __future__ import annotations

import subprocess
import sys


def test_importing_attnkit_does_not_import_numba():
    code = "import sys, attnkit, attnkit.numba_pool; assert 'numba' not in sys.modules, 'numba imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


# ---------------------------------------------------------------- run_items (opt-in, Python helper threads)
import threading  # noqa: E402

import pytest  # noqa: E402

from attnkit.numba_pool import run_items  # noqa: E402


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("items", [0, 1, 5, 64])
def test_run_items_runs_every_item_once(threads, items):
    seen = []
    lock = threading.Lock()

    def work(i):
        with lock:
            seen.append(i)

    run_items(work, items, threads=threads)
    assert sorted(seen) == list(range(items))


def test_run_items_uses_helper_threads():
    names = set()
    barrier = threading.Barrier(2, timeout=10)

    def work(i):
        names.add(threading.current_thread().name)
        if i < 2:
            barrier.wait()          # two items must run at the same time: the caller and one helper

    run_items(work, 4, threads=2)
    assert threading.current_thread().name in names and any(n.startswith("attnkit-items") for n in names)


def test_run_items_reraises_the_first_error_and_stops_handing_out():
    done = []

    def work(i):
        if i == 0:
            raise ValueError("item 0")
        done.append(i)

    with pytest.raises(ValueError, match="item 0"):
        run_items(work, 100, threads=1)
    assert done == []
    with pytest.raises(ValueError, match="item 0"):
        run_items(work, 100, threads=2)


def test_run_items_nested_calls_do_not_deadlock():
    """A call from inside an item (every helper possibly busy) still finishes: the caller works its items."""
    out = []
    lock = threading.Lock()

    def inner(i):
        with lock:
            out.append(i)

    run_items(lambda i: run_items(inner, 3, threads=4), 6, threads=4)
    assert sorted(out) == sorted(list(range(3)) * 6)


def _ranges_on(monkeypatch, where):
    import attnkit.numba_pool as pool
    if where == "omp" and pool._omp_parallel() is None:
        pytest.skip("torch's libgomp is not loaded here (torch built with another thread pool, or not Linux)")
    monkeypatch.setattr(pool, "KERNEL_TEAM", where)


@pytest.mark.parametrize("where", ["python", "omp"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("items", [0, 1, 5, 64])
def test_run_ranges_covers_every_item_once_in_contiguous_ranges(monkeypatch, where, threads, items):
    from attnkit.numba_pool import RANGES_PER_THREAD, run_ranges
    _ranges_on(monkeypatch, where)
    calls = []
    lock = threading.Lock()

    def kernel(tag, i0, i1):
        assert tag == "arg", "the leading arguments come first"
        with lock:
            calls.append((i0, i1))

    run_ranges(kernel, items, "arg", threads=threads)
    calls.sort()
    covered = [i for a, b in calls for i in range(a, b)]
    assert covered == list(range(items))
    assert all(a < b for a, b in calls), "no empty range is handed out"
    expected = 0 if items == 0 else 1 if threads == 1 else min(items, threads * RANGES_PER_THREAD)
    assert len(calls) == expected


@pytest.mark.parametrize("where", ["python", "omp"])
def test_run_ranges_runs_ranges_at_the_same_time_and_reraises(monkeypatch, where):
    """Two ranges run at once on two threads (a barrier both must reach), and the first error comes back to the
    caller; a call from inside a range finishes (no deadlock)."""
    from attnkit.numba_pool import run_ranges
    _ranges_on(monkeypatch, where)
    barrier = threading.Barrier(2, timeout=10)
    ids = set()

    def kernel(i0, i1):
        ids.add(threading.get_native_id())
        if i0 < 2:
            barrier.wait()

    run_ranges(kernel, 8, threads=2)
    assert len(ids) == 2

    def failing(i0, i1):
        if i0 == 0:
            raise ValueError("range 0")

    with pytest.raises(ValueError, match="range 0"):
        run_ranges(failing, 8, threads=2)
    seen = []
    lock = threading.Lock()

    def inner(i0, i1):
        with lock:
            seen.extend(range(i0, i1))

    run_ranges(lambda i0, i1: run_ranges(inner, 3, threads=2), 4, threads=2)
    assert sorted(seen) == sorted(list(range(3)) * 4)


@pytest.mark.parametrize("where", ["python", "omp"])
def test_run_items_on_a_team_runs_every_item_once(monkeypatch, where):
    from attnkit.numba_pool import run_items
    _ranges_on(monkeypatch, where)
    seen = []
    lock = threading.Lock()

    def work(i):
        with lock:
            seen.append(i)

    run_items(work, 37, threads=2, team=True)
    assert sorted(seen) == list(range(37))


def test_kernel_team_omp_without_torchs_libgomp_says_so(monkeypatch):
    import attnkit.numba_pool as pool
    monkeypatch.setattr(pool, "_omp", False)          # as where torch's libgomp is not loaded
    monkeypatch.setattr(pool, "KERNEL_TEAM", "omp")
    with pytest.raises(RuntimeError, match="KERNEL_TEAM='omp'.*libgomp is not loaded.*'auto' or 'python'"):
        pool.run_ranges(lambda i0, i1: None, 4, threads=2)
    monkeypatch.setattr(pool, "KERNEL_TEAM", "auto")  # auto falls back to Python threads
    seen = []
    pool.run_ranges(lambda i0, i1: seen.extend(range(i0, i1)), 4, threads=2)
    assert sorted(seen) == [0, 1, 2, 3]


def test_run_ranges_rejects_an_unknown_setting(monkeypatch):
    import attnkit.numba_pool as pool
    monkeypatch.setattr(pool, "KERNEL_TEAM", "gpu")
    with pytest.raises(ValueError, match="KERNEL_TEAM.*'auto', 'omp' or 'python', got 'gpu'"):
        pool.run_ranges(lambda i0, i1: None, 4, threads=2)


def test_start_pool_keeps_torch_thread_count():
    """Launching numba's OpenMP pool reset torch's thread count to the core count; start_pool restores it (a fresh
    interpreter: the pool launches once per process). Skipped where numba is not installed (the core's own venv)."""
    pytest.importorskip("numba")
    code = ("import torch; torch.set_num_threads(1)\n"
            "(torch.randn(256, 256) @ torch.randn(256, 256)).sum()\n"   # torch's OpenMP pool is up, as in a model
            "from attnkit.numba_pool import start_pool; start_pool()\n"
            "import numba; assert numba.get_num_threads() >= 1\n"
            "print(torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "1"
