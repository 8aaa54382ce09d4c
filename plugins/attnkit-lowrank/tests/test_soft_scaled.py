"""``soft`` at large input norms: its outputs leave float32's range, not its arithmetic.

SOFT's kernel ``exp(-scale/2 |q - k~|^2)`` has no normalisation, so the
mechanism's output itself (not an intermediate) shrinks like
``exp(-c · factor^2)`` when q and k are multiplied by ``factor``. These tests
measure that on the kit's own inputs and configurations (``make_inputs``,
seed 17, B = H = 2, D = 8, E = 6, L = 9 and 67):

* at x10 the float32 torch path matches the float64 reference (relative
  Frobenius error <= 1e-4) although the outputs are ~1e-15 to 1e-33: no
  intermediate underflows before the output does;
* at x30 the float64 reference's *largest* output entry is below float32's
  smallest subnormal (1.4e-45): every faithful float32 result is 0, and ours
  is. The kit's ``scaled_inputs`` holds the output to the reference rounded to
  the tested dtype, so it passes there; before that refinement it failed on
  any float32 implementation of SOFT (a per-row shift of the exponent factors
  out only as the output row's own magnitude, which is the number that does
  not fit).
"""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank.soft.naive import reference

import attnkit
from attnkit.testing.context import make_inputs

CONFIGS = [{}, {"stride": 3}, {"stride": 4, "bottleneck": "pool", "pinv_iterations": 8}]
SMALLEST_SUBNORMAL = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps


def _pair(opts):
    torch.manual_seed(0)
    attn = attnkit.build("soft", num_heads=2, head_dim=8, **opts).eval()
    ref_attn = attnkit.build("soft", num_heads=2, head_dim=8, **opts).eval().double()
    ref_attn.load_state_dict(attn.state_dict())
    return attn, ref_attn


@pytest.mark.parametrize("opts", CONFIGS)
@pytest.mark.parametrize("L", [9, 67])
def test_float32_matches_reference_at_x10(opts, L):
    attn, ref_attn = _pair(opts)
    q, k, v = make_inputs(2, 2, L, L, 8, 6, seed=17)
    q, k = q * 10, k * 10
    out = attn(q, k, v)
    want = reference(ref_attn, q.double(), k.double(), v.double())
    assert 0 < want.abs().max() < 1e-10         # tiny, yet inside float32's range
    err = torch.linalg.vector_norm(out.double() - want) / torch.linalg.vector_norm(want)
    assert err <= 1e-4


@pytest.mark.parametrize("opts", CONFIGS)
@pytest.mark.parametrize("L", [9, 67])
def test_output_leaves_float32_range_at_x30(opts, L):
    attn, ref_attn = _pair(opts)
    q, k, v = make_inputs(2, 2, L, L, 8, 6, seed=17)
    q, k = q * 30, k * 30
    want = reference(ref_attn, q.double(), k.double(), v.double())
    assert want.abs().max() < SMALLEST_SUBNORMAL / 2     # rounds to 0 in float32 however it is computed
    assert torch.equal(attn(q, k, v), torch.zeros_like(v))
