"""Which backend ``auto`` tries first for the content-based modules (lsh, routing, sinkhorn): a function of the
device and dtype, so it is checked here without a GPU."""

from __future__ import annotations

import pytest
import torch

import attnkit


@pytest.mark.parametrize("name, opts, triton_first", [
    ("lsh", {}, True), ("routing", {}, True), ("sinkhorn", {}, True),
    ("lsh", {"bucket_size": 48}, False),            # not a block the triton kernels take
    ("sinkhorn", {"block_size": 256}, False),       # a 256-row tile: too large to pick unasked
])
def test_auto_puts_triton_first_for_half_inputs_on_cuda_only(name, opts, triton_first):
    """The order ``auto`` tries (no GPU needed: the order is a function of device and dtype). Half inputs on CUDA
    try triton first where the block fits it; float32 on CUDA and every CPU input keep the declared order."""
    mod = attnkit.build(name, num_heads=2, head_dim=8, **opts)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float16):
        assert (mod._auto_order(cuda, dtype)[0] == "triton") is triton_first
        assert mod._auto_order(cpu, dtype) == tuple(mod.caps.backends)
    assert mod._auto_order(cuda, torch.float32) == tuple(mod.caps.backends) == ("numba", "torch", "triton")
