"""The ACT / Universal Transformer block: block suite, explicit-loop reference, halting weights, one-step limit."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.errors import InvalidInputError
from attnkit.testing import BlockConformance
from attnkit_adaptive.act.naive import reference


class TestACTBlockSuite(BlockConformance):
    name = "act"
    options = {"max_steps": 4, "halting_bias": -1.0}


class TestUniversalAliasEntmaxInside(BlockConformance):
    name = "universal"
    attention = "entmax"
    options = {"max_steps": 3, "halting_bias": 0.0}


class TestACTWithAdaptiveSpanInside(BlockConformance):
    name = "act"
    attention = "adaptive-span"
    options = {"max_steps": 3, "halting_bias": 0.0, "max_span": 8, "ramp": 2.0, "init_span": 3.0,
               "block_size": 4}


def _block(**kw):
    torch.manual_seed(0)
    opts = {"max_steps": 5, "halting_bias": -1.5, **kw}
    return attnkit.build_block("act", dim=8, num_heads=2, **opts).double()


def _x(B=2, L=7, seed=0):
    return torch.randn(B, L, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_equals_explicit_loop_reference(causal):
    block = _block()
    with torch.no_grad():
        block.halting.weight.normal_(0, 1.0)  # positions halt at different steps
    x = _x().requires_grad_()
    kpm = torch.ones(2, 7, dtype=torch.bool)
    kpm[1, 5:] = False
    out = block(x, causal=causal, key_padding_mask=kpm)
    info = block.last_info
    ref, weights, n, r = reference(block, x, causal=causal, key_padding_mask=kpm)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(info.steps, n)
    torch.testing.assert_close(info.remainders, r.detach())
    assert len(set(n.flatten().tolist())) > 1  # the positions really halt at different depths
    g = torch.randn_like(out)
    params = [x, block.halting.weight, block.halting.bias] + list(block.inner.parameters())
    ga = torch.autograd.grad(out, params, g, retain_graph=True)
    gb = torch.autograd.grad(ref, params, g)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_halting_weights_sum_to_one_and_ponder_cost():
    block = _block(max_steps=6, halting_bias=-2.0)
    x = _x()
    block(x, causal=True)
    info = block.last_info
    torch.testing.assert_close(info.weights.sum(0), torch.ones(2, 7, dtype=torch.float64))
    assert (info.weights >= 0).all() and (info.steps >= 1).all() and (info.steps <= 6).all()
    aux = attnkit.aux_losses(block, weighted=False)
    torch.testing.assert_close(aux["ponder"], info.ponder.mean())


def test_ponder_gradient_reaches_the_halting_unit():
    block = _block(max_steps=6, halting_bias=-2.0)
    block(_x(), causal=True)
    attnkit.aux_losses(block)["ponder"].backward()
    assert block.halting.bias.grad is not None and block.halting.bias.grad.abs() > 0


def test_high_halting_bias_is_one_application_of_the_inner_block():
    block = _block(halting_bias=50.0)
    x = _x()
    out = block(x, causal=True)
    assert (block.last_info.steps == 1).all()
    want = block.inner(x + block.coordinates(7, 0, x), causal=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    plain = _block(halting_bias=50.0, coordinate_embedding=False)
    torch.testing.assert_close(plain(x), plain.inner(x), atol=1e-12, rtol=0)


def test_low_halting_bias_runs_max_steps():
    block = _block(max_steps=3, halting_bias=-50.0)
    block(_x())
    assert (block.last_info.steps == 3).all()
    torch.testing.assert_close(block.last_info.remainders, torch.ones(2, 7, dtype=torch.float64), atol=1e-12,
                               rtol=0)


@pytest.mark.parametrize("kw,match", [
    ({"max_steps": 0}, r"max_steps: expected a positive int, got 0"),
    ({"epsilon": 0.0}, r"epsilon: expected a finite float in \(0, 1\), got 0.0"),
    ({"epsilon": 1.0}, r"epsilon: expected a finite float in \(0, 1\), got 1.0"),
    ({"epsilon": -0.5}, r"epsilon: .*got -0.5"),
    ({"halting_bias": float("inf")}, r"halting_bias: expected a finite"),
])
def test_bad_options(kw, match):
    with pytest.raises(InvalidInputError, match=match):
        attnkit.build_block("act", dim=8, num_heads=2, **kw)


def test_refuses_state():
    block = _block()
    with pytest.raises(InvalidInputError, match="keeps no state"):
        block(_x(), return_state=True)
