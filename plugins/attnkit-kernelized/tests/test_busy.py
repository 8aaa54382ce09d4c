"""Busy-machine mode (``_busy``): the decision from an injected load, what it changes, and that results stay."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit_kernelized import _busy, _numba


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def sampler(foreign_per_s: float, own_per_s: float = 1.0, cores: int = 2):
    """A LoadSampler whose machine: other processes use ``foreign_per_s`` cores, this one ``own_per_s``."""
    clock = FakeClock()
    s = _busy.LoadSampler(read_busy=lambda: clock.t * (foreign_per_s + own_per_s), read_own=lambda: clock.t * own_per_s,
                          clock=clock, cores=cores)
    return s, clock


@pytest.mark.parametrize(("foreign", "threads", "cores", "busy"), [
    (0.0, 2, 2, False), (0.3, 2, 2, False), (1.0, 2, 2, True), (2.0, 2, 2, True),
    (1.0, 1, 2, False),                      # one thread: nothing to drop
    (2.0, 14, 16, False), (3.0, 14, 16, True), (1.0, 16, 16, True),
])
def test_machine_busy(foreign, threads, cores, busy):
    assert _busy.machine_busy(foreign, threads, cores) is busy


def test_sampler_averages_over_its_window_and_caches_between():
    s, clock = sampler(foreign_per_s=1.5)
    assert s.sample() == 0.0                   # the first sample has no window yet
    clock.t = 0.05
    assert s.sample() == 0.0                   # within the window: the cached value, no read
    clock.t = 0.2
    assert s.sample() == pytest.approx(1.5)
    assert s.busy(2) and not s.busy(1)


def test_sampler_without_proc_stat_never_engages():
    clock = FakeClock()
    s = _busy.LoadSampler(read_busy=lambda: None, read_own=lambda: 0.0, clock=clock, cores=2)
    for t in (0.0, 1.0, 2.0):
        clock.t = t
        assert not s.busy(2)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
def test_busy_threads_drops_torch_to_one_thread_and_restores(two_threads):
    s, clock = sampler(foreign_per_s=2.0)
    s.sample()
    clock.t = 1.0
    with _busy.busy_threads("cpu", s) as engaged:
        assert engaged
        assert torch.get_num_threads() == 1
        assert _busy.kernel_thread_count() == 2            # the kernels keep torch's former count
        assert _numba.threads() == min(2, _numba._cap(2))
        with _busy.busy_threads("cpu", s) as inner:           # nested: the outer decision stands
            assert not inner and torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2 and _busy.kernel_thread_count() is None
    with pytest.raises(RuntimeError), _busy.busy_threads("cpu", s):  # restored on errors too
        raise RuntimeError
    assert torch.get_num_threads() == 2 and _busy.kernel_thread_count() is None


def test_busy_threads_idle_machine_and_other_devices_change_nothing(two_threads):
    s, clock = sampler(foreign_per_s=0.0)
    s.sample()
    clock.t = 1.0
    with _busy.busy_threads("cpu", s) as engaged:
        assert not engaged and torch.get_num_threads() == 2
    busy, clock = sampler(foreign_per_s=2.0)
    busy.sample()
    clock.t = 1.0
    with _busy.busy_threads("meta", busy) as engaged:
        assert not engaged and torch.get_num_threads() == 2


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
@pytest.mark.parametrize("name", ["linear", "performer"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_results_identical_with_the_mode_on(two_threads, monkeypatch, name, backend):
    """Forward and gradients in float64 are the same whether a call ran in busy mode or not (same operations,
    fewer threads); the mode engaged in the forward and in the kernels' backward."""
    opts = {"num_features": 32} if name == "performer" else {}
    torch.manual_seed(0)
    mod = attnkit.build(name, num_heads=2, head_dim=8, backend=backend, **opts).double()
    mod.segment_length = 16                                   # several segments: the state is carried
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))

    def run():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = mod(qq, kk, vv, causal=True)
        out.square().sum().backward()
        return out.detach(), qq.grad, kk.grad, vv.grad

    idle, clock = sampler(foreign_per_s=0.0)
    monkeypatch.setattr(_busy, "_sampler", idle)
    want = run()
    busy, clock = sampler(foreign_per_s=2.0)
    busy.sample()
    clock.t = 1.0
    monkeypatch.setattr(_busy, "_sampler", busy)
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    got = run()
    assert seen and seen[0] == 1 and torch.get_num_threads() == 2
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
