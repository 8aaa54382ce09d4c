"""float16 / bfloat16 inputs: every adaptive attention computes in float32 inside and answers in the input dtype.

Compared with the same module in float64 on the upcast half inputs (the kit's half tolerances): outputs and
the gradients of q, k, v (in the input dtype), for a float32 module called with half inputs (autocast-style:
float32 parameters and parameter gradients) and a module cast with ``.to(half)`` (half parameters, upcast per
call, half parameter gradients). Padded keys holding NaN/Inf have no influence; auxiliary losses stay finite.
"""

from __future__ import annotations

import copy

import pytest
import torch

import attnkit
from attnkit.testing.config import DEFAULT_ATOL, DEFAULT_RTOL

HALF = [torch.float16, torch.bfloat16]
CASES = {
    "adaptive-span-numba": ("adaptive-span", dict(max_span=12, ramp=2.0, init_span=6.0, block_size=4,
                                                  backend="numba"), True),
    "adaptive-span-torch": ("adaptive-span", dict(max_span=12, ramp=2.0, init_span=6.0, block_size=4,
                                                  backend="torch"), True),
    "dynamic-span-numba": ("dynamic-span", dict(max_span=12, ramp=2.0, init_span=4.0, block_size=4,
                                                backend="numba"), True),
    "entmax": ("entmax", dict(alpha=1.5), False),
    "sparse-adaptive": ("sparse-adaptive", dict(num_edges=5), True),
}


def _name(dt):
    return str(dt).split(".")[-1]


def _inputs(dtype, L=19, B=2, H=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _run(mod, xs, causal, kpm=None):
    out = mod(*xs, causal=causal, key_padding_mask=kpm)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out.double() * weights).sum().backward()
    return out


def _close(got, ref, dtype, scale=1.0):
    d = _name(dtype)
    torch.testing.assert_close(got.double(), ref.double(), atol=DEFAULT_ATOL[d] * scale, rtol=DEFAULT_RTOL[d] * scale)


@pytest.mark.parametrize("dtype", HALF, ids=_name)
@pytest.mark.parametrize("cast_module", [False, True], ids=["float32-module", "half-module"])
@pytest.mark.parametrize("case", list(CASES))
def test_half_inputs_agree_with_float64_in_the_input_dtype(case, cast_module, dtype):
    name, opts, causal = CASES[case]
    torch.manual_seed(0)
    mod = attnkit.build(name, num_heads=2, head_dim=8, **opts)
    if cast_module:
        mod = mod.to(dtype)
    ref_mod = copy.deepcopy(mod).double()
    xs = _inputs(dtype)
    out = _run(mod, xs, causal)
    ref_xs = [x.detach().double().requires_grad_() for x in xs]
    ref = _run(ref_mod, ref_xs, causal)
    assert out.dtype == dtype
    _close(out, ref, dtype, scale=2.0)
    for x, rx in zip(xs, ref_xs):
        assert x.grad is not None and x.grad.dtype == dtype
        _close(x.grad, rx.grad, dtype, scale=4.0)
    for p, rp in zip(mod.parameters(), ref_mod.parameters()):
        if p.requires_grad and rp.grad is not None:
            assert p.grad is not None and p.grad.dtype == (dtype if cast_module else torch.float32)
    for loss in mod.aux_losses().values() if hasattr(mod, "aux_losses") else ():
        assert torch.isfinite(loss).all()


@pytest.mark.parametrize("dtype", HALF, ids=_name)
@pytest.mark.parametrize("case", ["adaptive-span-numba", "entmax", "sparse-adaptive"])
def test_padded_keys_have_no_influence_and_empty_rows_are_zero_in_half(case, dtype):
    name, opts, causal = CASES[case]
    torch.manual_seed(0)
    mod = attnkit.build(name, num_heads=2, head_dim=8, **opts)
    q, k, v = (x.detach() for x in _inputs(dtype))
    kpm = torch.ones(2, 19, dtype=torch.bool)
    kpm[0, 12:] = False
    kpm[1, :] = False                                     # every key padded: zeros, not NaN
    clean = mod(q, k, v, causal=causal, key_padding_mask=kpm)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 12:] = float("nan")
    v2[0, :, 12:] = float("inf")
    poisoned = mod(q, k2, v2, causal=causal, key_padding_mask=kpm)
    assert poisoned.dtype == dtype and torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)
    assert (poisoned[1] == 0).all()


@pytest.mark.parametrize("dtype", HALF, ids=_name)
@pytest.mark.parametrize("case", list(CASES))
def test_the_mechanism_computes_in_float32(case, dtype, monkeypatch):
    """The float32 code runs (the span ramp, entmax's bisection and the edge top-k are not computed in half)."""
    name, opts, causal = CASES[case]
    mod = attnkit.build(name, num_heads=2, head_dim=8, **opts)
    seen = []
    inner = type(mod)._attend

    def spy(self, q, k, v, ctx):
        seen.append((q.dtype, k.dtype, v.dtype))
        return inner(self, q, k, v, ctx)
    monkeypatch.setattr(type(mod), "_attend", spy)
    out = mod(*(x.detach() for x in _inputs(dtype)), causal=causal)
    assert out.dtype == dtype and seen == [(torch.float32,) * 3]
