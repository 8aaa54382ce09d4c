"""torch.export with a dynamic length: the chunked torch forms of linear and gated (rfa) attention take a chunk count
of their own (``common.chunk_count``) and no Python loop over it, so one program serves every length; the numba
operators take any length; performer's log-space form decides its pairwise chunks with one torch.cond; fast-weight's
torch form still fixes the length."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit
from attnkit_kernelized.common import split_chunks
from attnkit_kernelized.linear.chunk import linear_num_den
from attnkit_kernelized.rfa.chunk import gated_num_den

LENGTHS = (1, 2, 63, 64, 65, 128, 129, 300)


class _Causal(torch.nn.Module):
    """``attn(q, k, v, causal=True)``, with a key padding mask when one is given."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, q, k, v, kpm=None):
        return self.attn(q, k, v, causal=True, key_padding_mask=kpm)


def _export(module, args, dims):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, dynamic_shapes=dims).module()


def _inputs(L, seed, *, gates=False):
    g = torch.Generator().manual_seed(seed)
    phi_q, phi_k = (torch.rand(2, 2, L, 5, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, L, 3, generator=g, dtype=torch.float64)
    S0 = torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64)
    z0 = torch.rand(2, 2, 5, generator=g, dtype=torch.float64)
    if not gates:
        return phi_q, phi_k, v, S0, z0
    # log decays from none to strong (exp(-8) per position): the closed form's weights span many orders
    log_g = -8.0 * torch.rand(2, 2, L, generator=g, dtype=torch.float64) ** 4
    return phi_q, phi_k, v, log_g, S0, z0


class _Linear(torch.nn.Module):
    def forward(self, phi_q, phi_k, v, S0, z0):
        return linear_num_den(phi_q, phi_k, v, S0, z0, causal=True, chunk=64)


class _Gated(torch.nn.Module):
    def forward(self, phi_q, phi_k, v, log_g, S0, z0):
        return gated_num_den(phi_q, phi_k, v, log_g, S0, z0, chunk=64)


@pytest.mark.parametrize("which", ["linear", "gated"])
def test_chunked_torch_forms_export_one_program_for_every_length(which):
    """Numerator, denominator and the final state (S, z) of the program equal the eager chunk loop at lengths
    below, at and across chunk boundaries (exported at L = 24: one chunk in the example)."""
    gates = which == "gated"
    module = _Gated() if gates else _Linear()
    L = torch.export.Dim("L", min=1, max=4096)
    seq = {2: L}
    dims = (seq, seq, seq, {2: L}, None, None) if gates else (seq, seq, seq, None, None)
    program = _export(module, _inputs(24, 0, gates=gates), dims)
    for n in LENGTHS:
        args = _inputs(n, n, gates=gates)
        for got, want in zip(program(*args), module(*args)):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_split_chunks_keeps_a_static_length_when_the_caller_loops():
    """A caller that loops over the chunks in Python (fast-weight) asks for the static form: the export then
    fixes the length (torch.export reports the dimension) rather than a loop over a data-dependent count."""

    class Split(torch.nn.Module):
        def forward(self, x):
            _, N, (chunks,) = split_chunks(64, x, dynamic=False)
            return sum(chunks[:, :, n].sum() for n in range(N))

    with pytest.raises(Exception, match="Constraints violated"):
        _export(Split(), (torch.randn(1, 1, 24, 2),), ({2: torch.export.Dim("L", min=1, max=512)},))


@pytest.mark.parametrize("name,backend", [("linear", "numba"), ("linear", "torch"), ("rfa", "numba"),
                                          ("rfa", "torch"), ("fast-weight", "numba")])
def test_causal_programs_with_a_dynamic_length_equal_eager(name, backend):
    """The declared backends (``Capabilities.export_dynamic``) with a key padding mask as an input of the same
    dynamic length: one program, the eager output at every length. (performer's programs: the kit's
    export_dynamic check and the large-norm test below.)"""
    assert backend in attnkit.get_spec(name).capabilities.export_dynamic
    torch.manual_seed(0)
    attn = attnkit.build(name, num_heads=2, head_dim=8, backend=backend).eval()
    call = _Causal(attn)

    def args(n, seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
        kpm = torch.ones(2, n, dtype=torch.bool)
        kpm[1, n - n // 3:] = False
        return q, k, v, kpm

    L = torch.export.Dim("L", min=1, max=4096)
    program = _export(call, args(24, 0), ({2: L}, {2: L}, {2: L}, {1: L}))
    for n in (1, 40, 64, 65, 200):
        a = args(n, n)
        torch.testing.assert_close(program(*a), call(*a), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,backend", [("fast-weight", "torch")])
def test_undeclared_causal_forms_fix_the_length(name, backend):
    """Not declared in export_dynamic: torch.export reports the length as specialised (no wrong program)."""
    assert backend not in attnkit.get_spec(name).capabilities.export_dynamic
    attn = attnkit.build(name, num_heads=2, head_dim=8, backend=backend).eval()
    call = _Causal(attn)

    L = torch.export.Dim("L", min=1, max=4096)
    with pytest.raises(Exception, match="Constraints violated"):
        _export(call, tuple(torch.randn(1, 2, 24, 8) for _ in range(3)), ({2: L}, {2: L}, {2: L}))


@pytest.mark.parametrize("feature_map", ["positive", "trig"])
def test_performer_program_takes_the_pairwise_branch_for_large_norms(feature_map):
    """Queries and keys scaled by 10 and 30: the key maxima grow past the limit inside chunks, so the program's
    torch.cond takes the branch with the pairwise blocks; the program still equals eager (no overflow, no
    all-zero rows) at lengths across chunk boundaries, saved and loaded."""
    import io

    from attnkit_kernelized.performer.chunk import GROWTH_LIMIT

    torch.manual_seed(0)
    attn = attnkit.build("performer", num_heads=2, head_dim=8, feature_map=feature_map).eval()
    call = _Causal(attn)

    L = torch.export.Dim("L", min=1, max=4096)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(call, tuple(torch.randn(2, 2, 24, 8) for _ in range(3)),
                                       dynamic_shapes=({2: L},) * 3)
        buf = io.BytesIO()
        torch.export.save(exported, buf)
        buf.seek(0)
        program = torch.export.load(buf).module()
    assert "cond" in str(exported.graph)
    for scale in (1.0, 10.0, 30.0):
        for n in (5, 65, 200):
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
            q, k = q * scale, k * scale
            with torch.no_grad():
                want = call(q, k, v)
                lk, _ = attn.log_features(k)
            if scale == 30.0 and feature_map == "positive":   # the case is the one meant: growth past the limit
                assert (lk.amax(2) - lk[:, :, :1].amax(2)).amax() > GROWTH_LIMIT[torch.float32]
            got = program(q, k, v)
            assert torch.isfinite(got).all() and (got.abs().sum(-1) > 0).all()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
