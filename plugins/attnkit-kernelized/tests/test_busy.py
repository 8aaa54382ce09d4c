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
    if name == "performer":
        mod.trained_segment_length = 16
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


# ------------------------------------------------------------------ a call's backward
@pytest.fixture
def busy_machine(monkeypatch):
    s, clock = sampler(foreign_per_s=2.0)
    s.sample()
    clock.t = 1.0
    monkeypatch.setattr(_busy, "_sampler", s)
    return s


class ThreadsAtUnpack:
    """Saved-tensor hooks recording torch's thread count whenever the backward unpacks a saved tensor (that is,
    inside the nodes that saved them)."""

    def __init__(self):
        self.seen: list[int] = []

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: (self.seen.append(torch.get_num_threads()), t)[1])
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def _qkv(L=24, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, L, 8, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
            for _ in range(3)]


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_the_calls_whole_backward_runs_on_one_thread_and_not_beyond(two_threads, busy_machine, backend):
    """Every node of the call's backward (each unpacks what it saved) runs on one thread on a busy machine;
    a node between two calls runs on torch's count; the count is back after the backward."""
    mod = attnkit.build("performer", num_heads=2, head_dim=8, num_features=16, backend=backend).double()
    mod.segment_length = mod.trained_segment_length = 8      # split, state scaling, several segments
    q, k, v = _qkv()
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    with ThreadsAtUnpack() as inner1:
        x = mod(q, k, v, causal=True)
    with ThreadsAtUnpack() as between:
        y = torch.tanh(x @ w)                                # saves tanh's output and x, w
    with ThreadsAtUnpack() as inner2:
        out = mod(y, y, y, causal=True)
    out.square().sum().backward()
    assert inner1.seen and set(inner1.seen) == {1}
    assert inner2.seen and set(inner2.seen) == {1}
    assert between.seen and set(between.seen) == {2}
    assert torch.get_num_threads() == 2 and _busy.kernel_thread_count() is None
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v, w))


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
def test_idle_machine_backward_keeps_the_count(two_threads):
    mod = attnkit.build("performer", num_heads=2, head_dim=8, num_features=16).double()
    q, k, v = _qkv()
    with ThreadsAtUnpack() as probe:
        out = mod(q, k, v, causal=True)
    idle, clock = sampler(foreign_per_s=0.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_busy, "_sampler", idle)
        out.sum().backward()
    assert probe.seen and set(probe.seen) == {2}


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
def test_span_ends_when_the_inputs_gradients_are_not_asked_for(two_threads, busy_machine):
    """A backward pass that needs only a parameter's gradient never reaches the inputs' node: the span ends
    with the pass (the engine's final callback)."""
    mod = attnkit.build("rfa", num_heads=2, head_dim=8, num_features=16, gate=True).double()
    q, k, v = _qkv()
    with ThreadsAtUnpack() as probe:
        out = mod(q, k, v, causal=True)
    (g,) = torch.autograd.grad(out.sum(), [mod.gate_weight])
    assert torch.isfinite(g).all()
    assert probe.seen and set(probe.seen) == {1}
    assert torch.get_num_threads() == 2 and _busy.kernel_thread_count() is None


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
def test_backward_that_raises_leaves_no_thread_count_behind(two_threads, busy_machine):
    """A backward pass that raises inside the span never reaches its end: the next call puts the count back."""
    mod = attnkit.build("performer", num_heads=2, head_dim=8, num_features=16).double()
    q, k, v = _qkv()

    def fail(t):
        raise RuntimeError("unpack failed")

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, fail):
        out = mod(q, k, v, causal=True)
    with pytest.raises(RuntimeError, match="unpack failed"):
        out.sum().backward()
    assert torch.get_num_threads() == 1                      # left by the failed pass ...
    with torch.no_grad():
        mod(q, k, v, causal=True)                            # ... until the next call
    assert torch.get_num_threads() == 2 and _busy.kernel_thread_count() is None
    with ThreadsAtUnpack() as probe:
        out = mod(q, k, v, causal=True)                      # and a later backward engages again
    out.sum().backward()
    assert probe.seen and set(probe.seen) == {1}
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
def test_backward_span_applies_only_to_eager_cpu_calls_that_need_gradients(busy_machine):
    q, k, v = _qkv()
    with torch.no_grad():
        assert _busy.backward_span(q, k, v)[1] is None
    assert _busy.backward_span(*_qkv(requires_grad=False))[1] is None
    assert _busy.backward_span(q.detach().to("meta").requires_grad_(), k, v)[1] is None
    marked, span = _busy.backward_span(q, None, v)
    assert span is not None and marked[1] is None
    assert marked[0] is not q and marked[0].grad_fn is not None and torch.equal(marked[0], q)


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
def test_output_may_still_be_modified_in_place(two_threads, busy_machine):
    """The span hooks the output's node, not the tensor: in-place ops on the output keep working where they did
    (the torch path; the numba operators' outputs, like SDPA's float32 output, are refused by autograd)."""
    mod = attnkit.build("performer", num_heads=2, head_dim=8, num_features=16, backend="torch").double()
    q, k, v = _qkv()
    out = mod(q, k, v, causal=True)
    out.mul_(2.0)
    out.sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    (2.0 * mod(q, k, v, causal=True)).sum().backward()
    for a, t in zip(want, (q, k, v), strict=True):
        torch.testing.assert_close(a, t.grad)


@pytest.mark.skipif(not _busy._OPENMP, reason="the mode engages only with torch's OpenMP backend")
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_calls_in_busy_mode(two_threads, busy_machine, reentrant):
    """Activation checkpointing reruns the forward inside the backward (a nested backward pass when reentrant):
    the gradients match a plain call and the count is back afterwards."""
    from torch.utils.checkpoint import checkpoint

    mod = attnkit.build("performer", num_heads=2, head_dim=8, num_features=16).double()
    mod.segment_length = mod.trained_segment_length = 8
    q, k, v = _qkv()
    mod(q, k, v, causal=True).square().sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = checkpoint(lambda a, b, c: mod(a, b, c, causal=True), q, k, v, use_reentrant=reentrant)
    out.square().sum().backward()
    assert torch.get_num_threads() == 2 and _busy.kernel_thread_count() is None
    for a, t in zip(want, (q, k, v), strict=True):
        torch.testing.assert_close(a, t.grad, rtol=1e-12, atol=1e-12)


def test_forward_mode_ad_passes_through_the_span():
    """Dual tensors (``torch.autograd.forward_ad``) that also need gradients: the call runs as under
    ``torch.func.jvp`` and takes no span (its identity node, a custom function, has no forward-mode rule: the
    first version refused the call)."""
    import torch.autograd.forward_ad as fwAD

    mod = attnkit.build("performer", num_heads=2, head_dim=8, num_features=16, backend="torch").double()
    q, k, v = _qkv()
    t = torch.randn_like(q)
    with fwAD.dual_level():
        out = mod(fwAD.make_dual(q, t), k, v, causal=True)
        tangent = fwAD.unpack_dual(out).tangent
    _, want = torch.func.jvp(lambda x: mod(x, k.detach(), v.detach(), causal=True), (q.detach(),), (t,))
    torch.testing.assert_close(tangent, want)
    out.sum().backward()                                     # and the backward still runs
    assert q.grad is not None and torch.isfinite(q.grad).all()
