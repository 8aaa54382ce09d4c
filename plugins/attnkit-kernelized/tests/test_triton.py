"""triton kernels against the torch path under TRITON_INTERPRET=1 (CPU tensors); the `kernels` nox session."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch
from comparisons import DTYPES
from comparisons import close as _close
from comparisons import grads as _grads
from comparisons import rand as _rand

import attnkit
from attnkit_kernelized import chunked

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

@pytest.fixture(scope="module")
def tk():
    """The triton kernel module, imported with TRITON_INTERPRET=1 (triton reads it when it decorates)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    name = "attnkit_kernelized.kernels.causal_triton"
    mod = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    yield mod
    mp.undo()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L,M,E,chunk", [(1, 4, 3, 16), (7, 5, 4, 16), (37, 20, 70, 16), (64, 8, 8, 32)])
def test_causal_linear_triton_matches_torch(tk, dtype, L, M, E, chunk):
    q = _rand((2, 2, L, M), 0, dtype, positive=True)
    k = _rand((2, 2, L, M), 1, dtype, positive=True)
    v = _rand((2, 2, L, E), 2, dtype)
    num, den, _ = chunked.causal_linear(q, k, v, chunk=8)
    n2, d2 = tk.causal_linear_triton(q, k, v, chunk=chunk)
    _close(n2, num, dtype)
    _close(d2, den, dtype)
    for a, b in zip(_grads([n2, d2], [q, k, v]), _grads([num, den], [q, k, v])):
        _close(a, b, dtype, 10)


@pytest.mark.parametrize("reverse", [False, True])
def test_triton_causal_product_reverse(tk, reverse):
    x, y = (torch.rand(3, 19, 6, dtype=torch.float64) for _ in range(2))
    w = torch.randn(3, 19, 5, dtype=torch.float64)
    A = x @ y.transpose(-1, -2)
    A = A.triu() if reverse else A.tril()
    torch.testing.assert_close(tk.causal_product(x, y, w, reverse=reverse, block_l=16), A @ w)


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_module_triton_backend_matches_torch(tk, name):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    opts = {"num_features": 12} if name == "performer" else {}
    torch.manual_seed(0)
    ref = attnkit.build(name, num_heads=2, head_dim=4, backend="torch", **opts).double()
    fast = attnkit.build(name, num_heads=2, head_dim=4, backend="triton", **opts).double()
    fast.load_state_dict(ref.state_dict())
    kpm = torch.ones(2, 21, dtype=torch.bool)
    kpm[0, 0] = False
    q, k, v = (_rand((2, 2, 21, 4), s, torch.float64) for s in (5, 6, 7))
    want = ref(q, k, v, causal=True, key_padding_mask=kpm)
    got = fast(q, k, v, causal=True, key_padding_mask=kpm)
    _close(got, want, torch.float64)
    for a, b in zip(_grads([got], [q, k, v]), _grads([want], [q, k, v])):
        _close(a, b, torch.float64, 10)


def test_triton_gradcheck_float64(tk):
    q = _rand((1, 1, 6, 3), 0, torch.float64, positive=True)
    k = _rand((1, 1, 6, 3), 1, torch.float64, positive=True)
    v = _rand((1, 1, 6, 2), 2, torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: tk.causal_linear_triton(q, k, v, chunk=16), (q, k, v))
