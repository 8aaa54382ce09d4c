"""torch.export with a dynamic length on the torch backend (the numba programs: test_span_export_numba.py): the
span band takes its block count from ``attnkit.transforms.chunk_count`` (an unbacked size) and its width from the
spans' values at run time (another unbacked size); sparse-adaptive scores all query rows at once and always takes
``num_edges`` edges (invalid ones appended), so one program serves every length, causal and not."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit

SPAN_LENGTHS = (1, 2, 7, 8, 9, 16, 17, 40, 65)     # block_size 8: below, at and across block boundaries
SAC_LENGTHS = (1, 2, 3, 15, 16, 17, 33, 70)        # chunk_size 16, num_edges 4: fewer keys than edges too


def _export(module, args, dims):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, dynamic_shapes=dims).module()


class _Call(torch.nn.Module):
    def __init__(self, attn, causal, padded):
        super().__init__()
        self.attn, self.causal, self.padded = attn, causal, padded

    def forward(self, q, k, v, kpm=None):
        return self.attn(q, k, v, causal=self.causal, key_padding_mask=kpm if self.padded else None)


def _args(L, seed, padded, S=None):
    g = torch.Generator().manual_seed(seed)
    S = L if S is None else S
    q = torch.randn(2, 2, L, 8, generator=g)
    k, v = (torch.randn(2, 2, S, 8, generator=g) for _ in range(2))
    if not padded:
        return q, k, v
    kpm = torch.ones(2, S, dtype=torch.bool)
    kpm[1, S - S // 3:] = False
    return q, k, v, kpm


def _check(attn, causal, padded, lengths, *, rtol=1e-5, atol=1e-6):
    module = _Call(attn.eval(), causal, padded)
    L = torch.export.Dim("L", min=1, max=4096)
    dims = ({2: L}, {2: L}, {2: L}) + (({1: L},) if padded else ())
    program = _export(module, _args(12, 0, padded), dims)
    for n in lengths:
        a = _args(n, n, padded)
        with torch.no_grad():
            torch.testing.assert_close(program(*a), module(*a), rtol=rtol, atol=atol)


def _span(name):
    torch.manual_seed(0)
    if name == "adaptive-span":
        attn = attnkit.build(name, num_heads=2, max_span=20, ramp=3.0, init_span=6.0, block_size=8, backend="torch")
        with torch.no_grad():
            attn.span_fraction.copy_(torch.tensor([0.3, 0.9]))   # spans 6 and 18: one and three blocks back
    else:
        attn = attnkit.build(name, num_heads=2, head_dim=8, max_span=20, ramp=3.0, init_span=6.0, block_size=8,
                             backend="torch")
        with torch.no_grad():
            attn.span_weight.normal_()                           # spans that differ per query
    return attn


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["adaptive-span", "dynamic-span"])
def test_span_programs_with_a_dynamic_length_equal_eager(name, padded):
    """Exported at L = 12 (two blocks of 8): the eager output at lengths from one position to several blocks."""
    assert attnkit.get_spec(name).capabilities.export_dynamic == ("numba", "torch")
    _check(_span(name), True, padded, SPAN_LENGTHS)


def _set_spans(attn, which):
    """Spans near 0 ("small") or near max_span = 20 ("large") on every head (and every query)."""
    with torch.no_grad():
        if hasattr(attn, "span_fraction"):
            attn.span_fraction.fill_(0.0 if which == "small" else 1.0)
        else:
            attn.span_weight.zero_()
            attn.span_bias.fill_(-20.0 if which == "small" else 20.0)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an operator returns (the band's scores: B·H·nq·C·(nb + 1)·C)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def _largest(fn, *args):
    with torch.no_grad(), _Largest() as mode:
        fn(*args)
    return mode.most


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["adaptive-span", "dynamic-span"])
def test_span_programs_follow_the_spans_given_after_export(name, padded, dynamic):
    """The band of a program is sized from the spans at run time (an unbacked size, asserted within the band of
    max_span): exported with spans near 0, then given spans near max_span (and back) through the program's
    state dict, it equals eager with those spans, and its largest tensor is that of eager (a band of
    ceil(2 / 8) = 1 block before its own for spans near 0, ceil(22 / 8) = 3 for spans near max_span = 20, ramp 3),
    at a static length and a dynamic one."""
    attn = _span(name)
    _set_spans(attn, "small")
    module = _Call(attn.eval(), True, padded)
    L = torch.export.Dim("L", min=1, max=4096)
    dims = (({2: L}, {2: L}, {2: L}) + (({1: L},) if padded else ())) if dynamic else None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(module, _args(40, 0, padded), dynamic_shapes=dims).module()
    B, H, C = 2, 2, 8
    for which, nb in (("small", 1), ("large", 3), ("small", 1)):
        _set_spans(attn, which)
        program.load_state_dict(module.state_dict())
        for n in ((1, 9, 40, 65) if dynamic else (40,)):
            a = _args(n, n, padded)
            with torch.no_grad():
                torch.testing.assert_close(program(*a), module(*a), rtol=1e-5, atol=1e-6)
        a = _args(40, 1, padded)
        assert _largest(program, *a) == _largest(module, *a) == B * H * 5 * C * (nb + 1) * C


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_sparse_adaptive_programs_with_a_dynamic_length_equal_eager(causal, padded):
    """Exported at L = 12 (one predictor chunk of 16): the eager chunk loop's output at lengths with fewer keys
    than edges, at and across chunk boundaries."""
    assert attnkit.get_spec("sparse-adaptive").capabilities.export_dynamic == ("torch",)
    torch.manual_seed(0)
    attn = attnkit.build("sparse-adaptive", num_heads=2, head_dim=8, num_edges=4, predictor_dim=4,
                         distance_buckets=4, chunk_size=16)
    _check(attn, causal, padded, SAC_LENGTHS)


def test_sparse_adaptive_cross_attention_keeps_both_lengths_dynamic():
    """Cross-attention (noncausal, L != S) with a Dim for the queries and another for the keys (the core's mask
    check guards L != S when exported at different lengths, so the program serves unequal pairs)."""
    torch.manual_seed(0)
    attn = attnkit.build("sparse-adaptive", num_heads=2, head_dim=8, num_edges=4, predictor_dim=4,
                         distance_buckets=4, chunk_size=16).eval()
    module = _Call(attn, False, True)
    L, S = torch.export.Dim("L", min=1, max=4096), torch.export.Dim("S", min=1, max=4096)
    program = _export(module, _args(12, 0, True, S=20), ({2: L}, {2: S}, {2: S}, {1: S}))
    for n, m in ((1, 9), (3, 2), (17, 40), (40, 17), (33, 5)):
        a = _args(n, n + m, True, S=m)
        with torch.no_grad():
            torch.testing.assert_close(program(*a), module(*a), rtol=1e-5, atol=1e-6)
