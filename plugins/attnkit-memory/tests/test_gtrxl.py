"""gtrxl: identity-like start, gates, state through the block (the block suite runs in test_conformance)."""

from __future__ import annotations

import pytest
import torch
from attnkit_memory.gtrxl.block import GRUGate

import attnkit
from attnkit.errors import InvalidInputError
from attnkit.testing import BlockConformance


def test_gate_is_identity_for_a_large_bias_and_near_it_at_the_default():
    torch.manual_seed(0)
    x, y = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    assert torch.allclose(GRUGate(8, gate_bias=40.0)(x, y), x, atol=1e-12)
    g = GRUGate(8, gate_bias=2.0)
    far = (g(x, y) - x).norm() / x.norm()
    g0 = GRUGate(8, gate_bias=0.0)
    g0.load_state_dict(g.state_dict())
    assert far < (g0(x, y) - x).norm() / x.norm()    # b_g > 0 pulls the start toward identity
    with torch.no_grad():
        g.w.weight.zero_()
        g.u_rz.weight.zero_()
    z = torch.sigmoid(torch.tensor(-2.0))
    torch.testing.assert_close(g(x, y), (1 - z) * x + z * torch.tanh(g.u_g(0.5 * x)))


def test_block_is_identity_with_a_large_gate_bias():
    torch.manual_seed(0)
    block = attnkit.build_block("gtrxl", dim=8, num_heads=2, gate_bias=50.0)
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(block(x, causal=True), x, atol=1e-6, rtol=0)


def test_block_carries_transformer_xl_state_and_steps():
    torch.manual_seed(0)
    block = attnkit.build_block("gtrxl", dim=8, num_heads=2, attention="transformer-xl", mem_len=3).double()
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    outs, st = [], None
    for s in range(0, 9, 3):
        o, st = block(x[:, s:s + 3], causal=True, state=st, return_state=True)
        outs.append(o)
    st2, outs2 = block.init_state(2), []
    for s in range(0, 9, 3):
        o, st2 = block.step(x[:, s:s + 3], st2)
        outs2.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), torch.cat(outs2, 1), atol=1e-12, rtol=1e-10)
    assert st.position == 9


@pytest.mark.parametrize("opts,word", [({"mlp_ratio": 0}, "mlp_ratio"), ({"gate_bias": float("inf")}, "gate_bias"),
                                       ({"dropout": 1.0}, "dropout")])
def test_bad_options(opts, word):
    with pytest.raises(InvalidInputError, match=word):
        attnkit.build_block("gtrxl", dim=8, num_heads=2, **opts)


class TestGTrXLWithTransformerXLBlockSuite(BlockConformance):
    """The block suite with transformer-xl inside (causal-only: the causal=False checks skip with the reason)."""

    name = "gtrxl"
    attention = "transformer-xl"
    options = {"mem_len": 4}
