"""``backend="auto"`` chooses numba for CPU tensors for every kernelized mechanism; for CUDA tensors the torch
forms for linear and performer (the specs declare numba, torch, triton; GPU run 5 measured their torch forms as
fast or faster in training) and the triton kernels for fast-weight and rfa (their ``backend_order``: fast-weight
3.1-4.8x its torch form forward+backward in run 5, causal rfa's chunk-parallel kernels 2.8-4.7x in run 6), while
``backend="triton"`` still forces the kernels; checked without a GPU: the core's choice
for a CUDA device, and the static choice used while ``torch.compile`` traces. Not marked ``triton``: it needs no
interpreter (the first test needs triton importable)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from comparisons import build

import attnkit
from attnkit.backends import select_backend

NAMES = ["linear", "performer", "rfa", "fast-weight"]
#: the mechanisms whose ``auto`` order puts the triton kernels first on CUDA (measured: docs/benchmarks.md)
ON_TRITON = ("fast-weight", "rfa")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton importable")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("needs_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_picks_the_measured_backend_for_cuda_and_numba_for_cpu(name, needs_grad, dtype):
    caps = attnkit.get_spec(name).capabilities
    assert caps.backends == ("numba", "torch", "triton")
    attn = build(name, **({"num_features": 8} if name in ("performer", "rfa") else {}))
    pick = {dev: select_backend(implementation=name, offered=attn._auto_order(torch.device(dev), dtype),
                                forward_only=caps.forward_only_backends, requested="auto", device=torch.device(dev),
                                needs_grad=needs_grad)
            for dev in ("cuda", "cpu")}
    assert pick == {"cuda": "triton" if name in ON_TRITON else "torch", "cpu": "numba"}
    forced = select_backend(implementation=name, offered=caps.backends, forward_only=caps.forward_only_backends,
                            requested="triton", device=torch.device("cuda"), needs_grad=needs_grad)
    assert forced == "triton"


@pytest.mark.parametrize("name", NAMES)
def test_the_static_choice_while_compiling_follows_the_order(name):
    attn = build(name, **({"num_features": 8} if name in ("performer", "rfa") else {}))
    assert attn._backend_while_compiling(torch.device("cuda"), True) == "torch"     # no dtype: the declared order
    on_cuda = "triton" if name in ON_TRITON else "torch"
    assert attn._backend_while_compiling(torch.device("cuda"), True, torch.float32) == on_cuda
    assert attn._backend_while_compiling(torch.device("cpu"), True, torch.float32) == "numba"
