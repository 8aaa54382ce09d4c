"""attnkit.cpu_buffers (a core module, tested here: this plugin's kernels use it and bring NumPy): a buffer is
handed out again only when nothing refers to it (no array, view or tensor made from it), the limit holds (least
recently used free buffers dropped first), small requests and a limit of 0 bypass the pool, and bad limits are
refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from attnkit import cpu_buffers
from attnkit.errors import InvalidInputError

MIB = 1 << 20


@pytest.fixture
def pool():
    """An empty pool with a 64 MiB limit; the previous limit and an empty pool afterwards."""
    before = cpu_buffers.limit()
    cpu_buffers.release()
    cpu_buffers.set_limit(64)
    yield cpu_buffers
    cpu_buffers.set_limit(before >> 20)
    cpu_buffers.release()


def test_a_buffer_comes_back_only_when_nothing_refers_to_it(pool):
    a = pool.empty((4, MIB), np.float32)              # 16 MiB
    addr = a.ctypes.data
    t = torch.from_numpy(a).view(2, -1)[1:]             # a tensor view of it
    v = a.reshape(-1)[5:]                               # a NumPy view of it
    del a
    b = pool.empty((4, MIB), np.float32)
    assert b.ctypes.data != addr                        # t and v still read it
    del t
    c = pool.empty((MIB, 4), np.float32)
    assert c.ctypes.data not in (addr, b.ctypes.data)   # v alone still holds it
    del v
    d = pool.empty((2, MIB, 2), np.float32)             # same bytes, another shape: the first buffer again
    assert d.ctypes.data == addr
    assert d.shape == (2, MIB, 2) and d.dtype == np.float32 and d.flags.c_contiguous
    del b, c, d
    e = pool.empty((2 * MIB,), np.float64)              # 16 MiB as float64: a free one of the same size
    assert e.dtype == np.float64
    assert pool.pooled_bytes() == 48 * MIB


def test_the_limit_drops_least_recently_used_free_buffers(pool):
    a = pool.empty((8 * MIB,), np.float32)              # 32 MiB
    b = pool.empty((4 * MIB,), np.float32)              # 16 MiB
    first = a.ctypes.data
    del a
    c = pool.empty((6 * MIB,), np.float32)              # 24 MiB: 72 > 64, the free 32 MiB one is dropped
    assert pool.pooled_bytes() == 40 * MIB
    d = pool.empty((10 * MIB,), np.float32)             # 40 MiB: nothing free to drop, a plain array
    assert pool.pooled_bytes() == 40 * MIB
    del b, c, d
    assert pool.release() == 40 * MIB and pool.pooled_bytes() == 0
    assert first  # (the dropped buffer's address may be reused by the allocator: not asserted)


def test_small_requests_and_a_zero_limit_bypass_the_pool(pool):
    small = pool.empty((16, 16), np.float32)
    assert small.shape == (16, 16) and pool.pooled_bytes() == 0
    pool.set_limit(0)
    big = pool.empty((4, MIB), np.float32)
    assert big.nbytes == 16 * MIB and pool.pooled_bytes() == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_limit_is_refused(pool, bad):
    with pytest.raises(InvalidInputError, match=r"mib: expected an int >= 0"):
        pool.set_limit(bad)


def test_the_environment_sets_the_limit_and_a_bad_value_is_named():
    code = "from attnkit import cpu_buffers; print(cpu_buffers.limit())"
    run = [sys.executable, "-c", code]
    env = {"PATH": "", "ATTNKIT_CPU_BUFFERS_MIB": "3"}
    assert subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.strip() == str(3 * MIB)
    bad = subprocess.run(run, env={**env, "ATTNKIT_CPU_BUFFERS_MIB": "lots"}, capture_output=True, text=True)
    assert bad.returncode != 0 and "ATTNKIT_CPU_BUFFERS_MIB: expected a whole number of MiB" in bad.stderr
