"""numba's threads follow ``torch.get_num_threads()`` and its idle threads sleep instead of spinning."""

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


@pytest.mark.parametrize("n", [1, 2, 64])
def test_kernel_threads_follow_torch(torch_threads, n):
    torch.set_num_threads(n)
    want = min(n, numba.config.NUMBA_NUM_THREADS)
    assert _numba.kernel_threads() == want
    before = numba.get_num_threads()
    assert _numba.dynamic(_threads_inside, np.ones(8)) == want      # what the kernel ran with
    assert numba.get_num_threads() == before                          # restored for other numba code


def test_a_real_kernel_runs_on_torch_thread_count(torch_threads, monkeypatch):
    """The linear-attention kernel goes through dynamic(): with torch at 1 thread numba is set to 1."""
    seen = []
    real = numba.set_num_threads

    def spy(n):
        seen.append(n)
        real(n)

    monkeypatch.setattr(numba, "set_num_threads", spy)          # the module object every caller reads it from
    torch.set_num_threads(1)
    from attnkit_kernelized.linear import numba_ops

    x = torch.rand(1, 2, 9, 4, dtype=torch.float64)
    numba_ops.linear_attention(x, x, x, causal=True)
    assert seen and seen[0] == 1


def test_busy_mode_hands_sequences_out_on_the_former_thread_count(torch_threads, monkeypatch):
    """Inside busy mode (torch dropped to 1 thread) the kernel runs through rows() -> run_items on the count
    torch had before, and gives the numba team's result (the same loop; LLVM may round the two builds' sums
    differently in the last bits)."""
    from attnkit_kernelized import _busy
    from attnkit_kernelized.linear import numba_ops

    seen = []
    real = _numba.run_items

    def spy(work, items, *, threads=None):
        seen.append(threads)
        real(work, items, threads=threads)

    monkeypatch.setattr(_numba, "run_items", spy)
    torch.set_num_threads(2)
    x = torch.rand(2, 3, 33, 4, dtype=torch.float64)
    want = numba_ops.linear_attention(x, x, x, causal=True)
    assert not seen
    monkeypatch.setattr(_busy._local, "threads", 2, raising=False)   # what busy_threads sets when it engages
    torch.set_num_threads(1)
    got = numba_ops.linear_attention(x, x, x, causal=True)
    assert seen == [min(2, numba.config.NUMBA_NUM_THREADS)]
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_run_parallel_takes_an_explicit_thread_count(torch_threads):
    """numba_pool.run_parallel(threads=) (what dynamic() passes in busy mode) overrides torch's count."""
    from attnkit.numba_pool import run_parallel

    torch.set_num_threads(1)
    want = min(2, numba.config.NUMBA_NUM_THREADS)
    assert run_parallel(_threads_inside, np.ones(8), threads=2) == want
    assert run_parallel(_threads_inside, np.ones(8)) == 1


def test_the_wait_policy_is_set_for_numba_only():
    """numba's libgomp is loaded with OMP_WAIT_POLICY=PASSIVE (idle threads sleep: no spinning against torch's
    pool), and the variable is not left set for the user's process (a fresh interpreter, no user setting)."""
    code = ("import os, attnkit_kernelized._numba as n, numba;"
            "print(os.environ.get('OMP_WAIT_POLICY'), numba.config.NUMBA_NUM_THREADS)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "None"
    env["OMP_WAIT_POLICY"] = "ACTIVE"                                  # a user's own choice is kept
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "ACTIVE"


def test_the_first_numba_use_keeps_torch_thread_count():
    """Launching numba's OpenMP pool (the first import of a numba kernel module) used to reset torch's thread count
    to the core count: ``torch.set_num_threads(1)`` set before it must still hold after a kernel call."""
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
