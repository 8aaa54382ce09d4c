"""torch.export with a dynamic length: transformer-xl and compressive (the plain forward, no memory state as an
input) keep the length on both backends. The relative shift is a view of row stride ``T - 1``; on the sdpa path
the shifted position terms are copied densely while the length is symbolic, so the elementwise operators that
build SDPA's additive mask ask no ``T - 1 != 1`` guard; memory-tokens' torch form already kept the length."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit

LENGTHS = (1, 2, 3, 15, 16, 17, 63, 64, 65, 130)


def _export(module, args, dims):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, dynamic_shapes=dims).module()


class _Call(torch.nn.Module):
    def __init__(self, attn, padded):
        super().__init__()
        self.attn, self.padded = attn, padded

    def forward(self, q, k, v, kpm=None):
        if self.padded:
            return self.attn(q, k, v, causal=True, key_padding_mask=kpm)
        return self.attn(q, k, v, causal=True)


def _args(n, seed, padded):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    if not padded:
        return q, k, v
    kpm = torch.ones(2, n, dtype=torch.bool)
    kpm[1, n - n // 3:] = False
    return q, k, v, kpm


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "key-padding"])
@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize("name,options", [
    ("transformer-xl", {"mem_len": 16}),
    ("compressive", {"mem_len": 16, "cmem_len": 4, "compression_rate": 4}),
    ("compressive", {"mem_len": 8, "compression": "most_used"}),
], ids=["transformer-xl", "compressive-mean", "compressive-most-used"])
def test_causal_programs_with_a_dynamic_length_equal_eager(name, options, backend, padded):
    """Declared backends: one program (exported at L = 24) gives the eager output at lengths below, at and
    across mem_len and the example's length, with and without a key padding mask input of the same length."""
    assert backend in attnkit.get_spec(name).capabilities.export_dynamic
    torch.manual_seed(0)
    attn = attnkit.build(name, num_heads=2, head_dim=8, backend=backend, **options).double().eval()
    module = _Call(attn, padded)
    L = torch.export.Dim("L", min=1, max=4096)
    dims = ({2: L}, {2: L}, {2: L}) + (({1: L},) if padded else ())
    program = _export(module, _args(24, 0, padded), dims)
    for n in LENGTHS:
        a = _args(n, n, padded)
        with torch.no_grad():
            want = module(*a)
        torch.testing.assert_close(program(*a), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_a_bounded_span_keeps_the_length_up_to_max_distance(backend):
    """With ``max_distance`` (the instance's max_length) the length stays dynamic up to that bound."""
    torch.manual_seed(0)
    attn = attnkit.build("transformer-xl", num_heads=2, head_dim=8, max_distance=200,
                         backend=backend).double().eval()
    module = _Call(attn, False)
    L = torch.export.Dim("L", min=1, max=200)
    program = _export(module, _args(9, 0, False), ({2: L}, {2: L}, {2: L}))
    for n in (1, 50, 199, 200):
        a = _args(n, n, False)
        with torch.no_grad():
            want = module(*a)
        torch.testing.assert_close(program(*a), want, rtol=1e-10, atol=1e-12)

