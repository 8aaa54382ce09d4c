"""torch.export with a dynamic length: the chunked torch forms of linear and gated (rfa) attention take a chunk count
of their own (``common.chunk_count``) and no Python loop over it, so one program serves every length (the gated
form's chunk start states in two levels, ``common.chunk_outputs``); the numba operators take any length; performer's
program chooses its form with torch.cond (the linear kernels on the numba feature operators within the bounds, else
the log-space form, with the marked chunks' pairwise blocks where needed); fast-weight's torch form still fixes the
length."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit
from attnkit_kernelized.common import chunk_outputs, split_chunks
from attnkit_kernelized.linear.chunk import linear_num_den
from attnkit_kernelized.rfa.chunk import gated_num_den

LENGTHS = (1, 2, 63, 64, 65, 128, 129, 300, 600, 1100)   # (600, 1100: more than one group of 8 chunks)


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


def _sequential_outputs(ends, init, kv, S0, q, intra):
    """Chunk by chunk: ``out_n = intra_n + q_n S_n``, ``S_{n+1} = exp(ends_{n-1} - ends_n) S_n + kv_n``."""
    S, level, outs = S0, init, []
    for n in range(ends.shape[2]):
        outs.append(intra[:, :, n] + q[:, :, n] @ S)
        S = torch.exp(level - ends[:, :, n]).unsqueeze(-1) * S + kv[:, :, n]
        level = ends[:, :, n]
    return torch.stack(outs, dim=2), S


@pytest.mark.parametrize("levels", [1, 5])
@pytest.mark.parametrize("N,group", [(8, 1), (8, 8), (24, 8), (24, 4), (6, 2)])
def test_chunk_outputs_equal_the_sequential_recurrence(levels, N, group):
    """The two-level form (groups' totals, their start states in closed form, the recurrence inside each group)
    against the chunk-by-chunk recurrence in float64: values, the final state and the gradients of every input,
    with one level for every feature (rfa) and one per feature (performer), levels rising over several orders of
    magnitude and a carried state at a level far below them (performer's reference of a state that saw no key)."""
    g = torch.Generator().manual_seed(N * 10 + group + levels)
    B, H, M, F, C = 2, 2, 5, 3, 4
    ends = torch.cumsum(6.0 * torch.rand(B, H, N, levels, generator=g, dtype=torch.float64), dim=2)
    init = torch.full((B, H, levels), -1e3, dtype=torch.float64)
    init[0] = 0.0
    kv, q, intra = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in
                    ((B, H, N, M, F), (B, H, N, C, M), (B, H, N, C, F)))
    S0 = torch.randn(B, H, M, F, generator=g, dtype=torch.float64)
    leaves = tuple(x.requires_grad_() for x in (kv, S0, q, intra))
    got = chunk_outputs(ends, init, kv, S0, q, intra, group=group)
    want = _sequential_outputs(ends, init, kv, S0, q, intra)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    weights = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in got]
    grads = [torch.autograd.grad(sum((x * w).sum() for x, w in zip(res, weights)), leaves) for res in (got, want)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


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
    log-space form selects those chunks for their pairwise blocks (a selection of data-dependent size, no
    torch.cond of its own); the program still equals eager (no overflow, no all-zero rows) at lengths across
    chunk boundaries, saved and loaded. The positive map's program on numba holds the feature operators and its
    one torch.cond, and takes each of its three forms: the linear kernels (scale 1), the log-space form with no
    chunk selected (one key of large norm repeated: beyond the bounds, no growth) and with some (scale 30); which
    one each input takes is read from the key operator's bounds and growth."""
    import io

    from attnkit_kernelized.performer.chunk import GROWTH_LIMIT
    from attnkit_kernelized.performer.module import BOUNDED_EXPONENT
    from attnkit_kernelized.performer.numba_features import positive_features

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
    graph = exported.graph_module.print_readable(print_output=False)       # (with the branches' graphs)
    assert "nonzero" in graph                                   # the marked chunks' selection
    assert ("higher_order.cond" in graph) == (feature_map == "positive")   # the linear kernels or the log-space form
    if feature_map == "positive":
        assert "numba_performer_key_features" in graph
    seen = set()
    for scale in (1.0, 10.0, 30.0, "one key"):
        for n in (5, 65, 200):
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
            if scale == "one key":
                k = 10.0 * k[:, :, :1].expand_as(k).contiguous()
            else:
                q, k = q * scale, k * scale
            with torch.no_grad():
                want = call(q, k, v)
                lk, _ = attn.log_features(k)
            if scale == 30.0 and feature_map == "positive":   # the case is the one meant: growth past the limit
                assert (lk.amax(2) - lk[:, :, :1].amax(2)).amax() > GROWTH_LIMIT[torch.float32]
            if feature_map == "positive":
                s = attn.get_scale(q) ** 0.5
                _, _, hi, lo, growth = positive_features(q, k, attn.features * s, s * s, None, attn.chunk_size)
                bound = BOUNDED_EXPONENT[torch.float32]
                bounded = bool(lo.amin() >= -bound) and bool(hi.amax() <= bound)
                seen.add("linear" if bounded else "pairwise" if growth.amax() > GROWTH_LIMIT[torch.float32]
                         else "log-space")
            got = program(q, k, v)
            assert torch.isfinite(got).all() and (got.abs().sum(-1) > 0).all()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert feature_map != "positive" or seen == {"linear", "log-space", "pairwise"}


def test_performer_programs_of_two_layers_and_their_gradients():
    """Two performer layers in one program (static lengths, the second on the first's output; float64): each
    layer's torch.cond sits beside the other's (a grad-mode switch inside a branch made torch.export's
    set-grad pass lose the nested branches' graphs), and the program's gradients equal eager's on both forms
    (the numba feature and linear operators' backward inside the condition; the log-space form at scale 30)."""

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = attnkit.build("performer", num_heads=2, head_dim=8).double().eval()
            self.b = attnkit.build("performer", num_heads=2, head_dim=8).double().eval()

        def forward(self, q, k, v):
            x = self.a(q, k, v, causal=True)
            return self.b(x, k, x, causal=True)

    model = Two()
    example = tuple(torch.randn(1, 2, 40, 8, dtype=torch.float64) for _ in range(3))
    program = _export(model, example, None)
    for scale in (1.0, 30.0):
        g = torch.Generator().manual_seed(int(scale))
        args = [torch.randn(1, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(3)]
        args = [(x * scale if i < 2 else x).requires_grad_() for i, x in enumerate(args)]
        got, want = program(*args), model(*args)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for a, b in zip(torch.autograd.grad(got.square().sum(), args), torch.autograd.grad(want.square().sum(), args),
                        strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_performer_dynamic_program_gradients_equal_eager():
    """Gradients through a dynamic-length causal performer program (float64, numba, exported at 24, run at 131)
    equal eager's for inputs taking each of its three forms, read from the key operator's bounds and growth as
    the program reads them: the linear kernels (scale 1), the log-space form (one key of large norm repeated:
    beyond float64's bounds, no growth) and its pairwise blocks (scale 30). Autograd re-traces the program's
    ``torch.cond`` branches, where a padding of symbolic width once failed (``F.pad`` reads its widths as
    integers: ``common.pad_length`` concatenates)."""
    from attnkit_kernelized.performer.chunk import GROWTH_LIMIT
    from attnkit_kernelized.performer.module import BOUNDED_EXPONENT
    from attnkit_kernelized.performer.numba_features import positive_features

    torch.manual_seed(0)
    attn = attnkit.build("performer", num_heads=2, head_dim=8, backend="numba").double()
    model = _Causal(attn)
    L = torch.export.Dim("L", min=2, max=512)
    example = tuple(torch.randn(1, 2, 24, 8, dtype=torch.float64) for _ in range(3))
    program = _export(model, example, ({2: L},) * 3)
    seen = set()
    for scale in (1.0, "one key", 30.0):
        g = torch.Generator().manual_seed(131)
        q, k, v = (torch.randn(1, 2, 131, 8, generator=g, dtype=torch.float64) for _ in range(3))
        if scale == "one key":
            k = 40.0 * k[:, :, :1].expand_as(k).contiguous()
        else:
            q, k = q * scale, k * scale
        s = attn.get_scale(q) ** 0.5
        with torch.no_grad():
            _, _, hi, lo, growth = positive_features(q, k, attn.features * s, s * s, None, attn.chunk_size)
        bound = BOUNDED_EXPONENT[torch.float64]
        seen.add("linear" if bool(lo.amin() >= -bound) and bool(hi.amax() <= bound) else
                 "pairwise" if growth.amax() > GROWTH_LIMIT[torch.float64] else "log-space")
        grads = []
        for fn in (program, model):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = fn(*leaves)
            grads.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
        for got, want in zip(*grads, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    assert seen == {"linear", "log-space", "pairwise"}
