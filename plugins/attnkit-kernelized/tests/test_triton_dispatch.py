"""``backend="auto"`` chooses numba for CPU tensors and the torch forms for CUDA tensors for every kernelized
mechanism (the specs declare numba, torch, triton: the triton kernels measured slower than SDPA on an H100),
while ``backend="triton"`` still forces the kernels; checked without a GPU: the core's choice for a CUDA device,
and the static choice used while ``torch.compile`` traces. Not marked ``triton``: it needs no interpreter (the
first test needs triton importable)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from comparisons import build

import attnkit
from attnkit.backends import select_backend

NAMES = ["linear", "performer", "rfa", "fast-weight"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton importable")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("needs_grad", [False, True])
def test_auto_picks_torch_for_cuda_and_numba_for_cpu(name, needs_grad):
    caps = attnkit.get_spec(name).capabilities
    assert caps.backends == ("numba", "torch", "triton")
    pick = {dev: select_backend(implementation=name, offered=caps.backends, forward_only=caps.forward_only_backends,
                                requested="auto", device=torch.device(dev), needs_grad=needs_grad)
            for dev in ("cuda", "cpu")}
    assert pick == {"cuda": "torch", "cpu": "numba"}
    forced = select_backend(implementation=name, offered=caps.backends, forward_only=caps.forward_only_backends,
                            requested="triton", device=torch.device("cuda"), needs_grad=needs_grad)
    assert forced == "triton"


@pytest.mark.parametrize("name", NAMES)
def test_the_static_choice_while_compiling_is_torch_on_cuda(name):
    attn = build(name, **({"num_features": 8} if name in ("performer", "rfa") else {}))
    assert attn._backend_while_compiling(torch.device("cuda"), True) == "torch"
    assert attn._backend_while_compiling(torch.device("cpu"), True) == "numba"
