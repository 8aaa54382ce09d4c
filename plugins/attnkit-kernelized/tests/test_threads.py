"""The numba kernels run on ``torch.get_num_threads()`` threads (the count torch had, in busy mode); the core's
``parallel=True`` helpers keep an explicit count and a sleeping idle policy."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

from attnkit_kernelized import _numba


@numba.njit(parallel=True)
def _threads_inside(x):  # pragma: no cover - compiled
    total = 0.0
    for i in numba.prange(x.shape[0]):
        total += x[i]
    return numba.get_num_threads()


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def ranges_spy(monkeypatch):
    """The thread counts :func:`attnkit_kernelized._numba.rows` hands to ``run_ranges``, call by call."""
    seen = []
    real = _numba.run_ranges

    def spy(kernel, items, *args, threads=None):
        seen.append(threads)
        real(kernel, items, *args, threads=threads)

    monkeypatch.setattr(_numba, "run_ranges", spy)
    return seen


@pytest.mark.parametrize("n", [1, 2, 64])
def test_kernel_threads_follow_torch(torch_threads, ranges_spy, n):
    """rows() runs a kernel on torch's thread count (capped by the cores numba sees), every item once."""
    torch.set_num_threads(n)
    want = min(n, numba.config.NUMBA_NUM_THREADS)
    assert _numba.kernel_threads() == want
    hits = np.zeros(37, dtype=np.int64)

    def kernel(out, i0, i1):
        out[i0:i1] += 1

    _numba.rows(kernel, 37, hits)
    assert ranges_spy == [want]
    assert (hits == 1).all()


def test_rows_in_blocks_of_items_passes_element_bounds(ranges_spy):
    """With ``item``, the kernel gets element bounds: multiples of ``item`` but the last, covering every element."""
    bounds = []
    _numba.rows(lambda i0, i1: bounds.append((i0, i1)), 10_000, item=4096)
    bounds.sort()
    assert bounds[0][0] == 0 and bounds[-1][1] == 10_000
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(i0 % 4096 == 0 for i0, _ in bounds)


def test_a_real_kernel_runs_on_torch_thread_count(torch_threads, ranges_spy):
    """The linear-attention kernel goes through rows(): with torch at 1 thread it runs on 1."""
    torch.set_num_threads(1)
    from attnkit_kernelized.linear import numba_ops

    x = torch.rand(1, 2, 9, 4, dtype=torch.float64)
    numba_ops.linear_attention(x, x, x, causal=True)
    assert ranges_spy and set(ranges_spy) == {1}


def test_busy_mode_hands_sequences_out_on_the_former_thread_count(torch_threads, ranges_spy, monkeypatch):
    """Inside busy mode (torch dropped to 1 thread) the kernel runs on the count torch had before, and gives the
    same result bit for bit (each sequence is computed by one thread with the same code, whatever the count)."""
    from attnkit_kernelized import _busy
    from attnkit_kernelized.linear import numba_ops

    torch.set_num_threads(1)
    x = torch.rand(2, 3, 33, 4, dtype=torch.float64)
    want = numba_ops.linear_attention(x, x, x, causal=True)
    assert set(ranges_spy) == {1}
    ranges_spy.clear()
    monkeypatch.setattr(_busy._local, "threads", 2, raising=False)   # what busy_threads sets when it engages
    got = numba_ops.linear_attention(x, x, x, causal=True)
    assert set(ranges_spy) == {min(2, numba.config.NUMBA_NUM_THREADS)}
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_run_parallel_takes_an_explicit_thread_count(torch_threads):
    """The core's numba_pool.run_parallel (for plugins that keep ``parallel=True`` kernels; this plugin has none
    left) runs on ``threads=`` instead of torch's count. Tested here, where numba is installed."""
    from attnkit.numba_pool import run_parallel, start_pool

    start_pool()   # what a plugin with parallel=True kernels calls first: launching the pool resets torch's count
    torch.set_num_threads(1)
    want = min(2, numba.config.NUMBA_NUM_THREADS)
    assert run_parallel(_threads_inside, np.ones(8), threads=2) == want
    assert run_parallel(_threads_inside, np.ones(8)) == 1


def test_the_wait_policy_is_set_for_numba_only():
    """start_pool (the core's, for ``parallel=True`` kernels) loads numba's libgomp with OMP_WAIT_POLICY=PASSIVE
    (idle threads sleep: no spinning against torch's pool), and the variable is not left set for the user's
    process (a fresh interpreter, no user setting)."""
    code = ("import os, numba; from attnkit.numba_pool import start_pool; start_pool();"
            "print(os.environ.get('OMP_WAIT_POLICY'), numba.config.NUMBA_NUM_THREADS)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "None"
    env["OMP_WAIT_POLICY"] = "ACTIVE"                                  # a user's own choice is kept
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "ACTIVE"


def test_the_first_numba_use_keeps_torch_thread_count():
    """The first kernel calls (numba's import, the kernels run on a team of torch's OpenMP pool) leave torch's
    thread count as the user set it: ``torch.set_num_threads(1)`` set before must still hold after them."""
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "import attnkit\n"
        "m = attnkit.build('linear', backend='numba')\n"
        "q = torch.randn(1, 2, 40, 8)\n"
        "with torch.no_grad():\n"
        "    m(q, q, q, causal=True)\n"
        "m(q, q, q.requires_grad_(), causal=True).sum().backward()\n"
        "print(torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "1"
