"""The span mechanisms' numba kernels as custom operators (``attnkit_adaptive::span_band`` and its backward): the
programs of ``torch.export`` (a static and a dynamic length, with and without a key padding mask input) hold the
operator and equal eager; saved, they load in a process that imports only ``attnkit_adaptive``; gradients through
the operator equal the torch band path's; ``torch.library.opcheck``; a compiled training step."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import pytest
import torch

import attnkit

pytest.importorskip("numba")

from attnkit_adaptive.span.band import span_band_attention  # noqa: E402
from attnkit_adaptive.span.numba_band import span_band_attention_numba  # noqa: E402
from attnkit_adaptive.span.ops import span_band, span_band_backward  # noqa: E402

OP = "attnkit_adaptive.span_band.default"
LENGTHS = (1, 5, 12, 13, 31, 67)    # block_size 8: within one block, across blocks, none a multiple of it but 0


class _Call(torch.nn.Module):
    def __init__(self, attn, padded):
        super().__init__()
        self.attn, self.padded = attn, padded

    def forward(self, q, k, v, kpm=None):
        return self.attn(q, k, v, causal=True, key_padding_mask=kpm if self.padded else None)


def _args(L, seed, padded):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g) for _ in range(3))
    if not padded:
        return q, k, v
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, L - L // 3:] = False
    return q, k, v, kpm


def _span(name, backend="auto"):
    torch.manual_seed(0)
    if name == "adaptive-span":
        attn = attnkit.build(name, num_heads=2, max_span=20, ramp=3.0, block_size=8, backend=backend)
        with torch.no_grad():
            attn.span_fraction.copy_(torch.tensor([0.3, 0.9]))   # spans 6 and 18: one and three blocks back
    else:
        attn = attnkit.build(name, num_heads=2, head_dim=8, max_span=20, ramp=3.0, init_span=6.0, block_size=8,
                             backend=backend)
        with torch.no_grad():
            attn.span_weight.normal_()                           # spans that differ per query
    return attn.eval()


def _export(module, args, dynamic):
    L = torch.export.Dim("L", min=1, max=4096)
    dims = ((({2: L},) * 3) + (({1: L},) if len(args) == 4 else ())) if dynamic else None
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args, dynamic_shapes=dims)


def _saved_and_loaded(ep):
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _targets(ep):
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["adaptive-span", "dynamic-span"])
def test_programs_hold_the_operator_and_equal_eager(name, padded, dynamic):
    """backend="auto" exports the numba operator on CPU (once, no torch band); the program, saved and loaded,
    equals the eager module (numba) at the length it was exported at (other inputs) or, with a dynamic length,
    from one position to several blocks."""
    caps = attnkit.get_spec(name).capabilities
    assert "numba" in caps.export_backends and "numba" in caps.export_dynamic
    module = _Call(_span(name), padded)
    ep = _export(module, _args(12, 0, padded), dynamic)
    targets = _targets(ep)
    assert targets.count(OP) == 1, targets
    # no torch band in the program: no unfold or gather of key windows, no span maximum read with .item()
    assert not any(t.startswith(("aten.unfold", "aten._local_scalar_dense", "aten.index.")) for t in targets), targets
    program = _saved_and_loaded(ep).module()
    for n in LENGTHS if dynamic else (12,):
        a = _args(n, n + 1, padded)
        with torch.no_grad():
            torch.testing.assert_close(program(*a), module(*a), rtol=1e-6, atol=1e-6)


def test_a_forced_numba_backend_exports_the_operator_and_follows_spans_loaded_later():
    """backend="numba": the program reads the spans when it runs (each query's reach is computed inside the
    operator), so spans loaded into it after the export give the eager output with those spans."""
    attn = _span("adaptive-span", backend="numba")
    module = _Call(attn, True)
    program = _export(module, _args(12, 0, True), True).module()
    for fractions in ([0.0, 0.05], [1.0, 1.0], [0.3, 0.9]):
        with torch.no_grad():
            attn.span_fraction.copy_(torch.tensor(fractions))
        program.load_state_dict(module.state_dict())
        for n in (7, 40):
            a = _args(n, n, True)
            with torch.no_grad():
                torch.testing.assert_close(program(*a), module(*a), rtol=1e-6, atol=1e-6)


def test_a_saved_program_loads_in_a_process_that_imports_only_the_plugin(tmp_path):
    """``torch.export.load`` needs the operator registered: ``import attnkit_adaptive`` registers it."""
    module = _Call(_span("dynamic-span"), True)
    torch.export.save(_export(module, _args(12, 0, True), True), tmp_path / "program.pt2")
    a = _args(21, 3, True)
    torch.save(a, tmp_path / "inputs.pt")
    code = ("import sys, torch, attnkit_adaptive; d = sys.argv[1]; "
            "p = torch.export.load(d + '/program.pt2').module(); "
            "torch.save(p(*torch.load(d + '/inputs.pt')), d + '/out.pt')")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "out.pt"), module(*a), rtol=1e-6, atol=1e-6)


def _inputs(per_query, padded, L=19, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    if per_query:
        z = (torch.rand(2, 2, L, generator=g, dtype=torch.float64) * 12).requires_grad_()
    else:
        z = torch.tensor([2.5, 9.0], dtype=torch.float64).view(1, 2, 1).requires_grad_()
    kpm = None
    if padded:
        kpm = torch.ones(2, L, dtype=torch.bool)
        kpm[1, L - 6:] = False
        kpm[0, 2] = False
    return q, k, v, z, kpm


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("per_query", [False, True])
def test_gradients_through_the_operator_equal_the_torch_band_path(per_query, padded):
    """float64: the output and the gradients of q, k, v and of the spans (per head, per query) through the
    operator's registered autograd equal the torch band path's."""
    q, k, v, z, kpm = _inputs(per_query, padded)
    a = span_band_attention_numba(q, k, v, z, 2.5, scale=0.4, key_padding_mask=kpm, block_size=4, key_block=8)
    b = span_band_attention(q, k, v, z, 2.5, scale=0.4, key_padding_mask=kpm, block_size=4)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    w = torch.randn(a.shape, generator=torch.Generator().manual_seed(1), dtype=a.dtype)
    got = torch.autograd.grad((a * w).sum(), (q, k, v, z))
    want = torch.autograd.grad((b * w).sum(), (q, k, v, z))
    for n, x, y in zip("q k v z".split(), got, want):
        assert x.shape == y.shape, n
        torch.testing.assert_close(x, y, atol=1e-11, rtol=1e-9, msg=lambda m, n=n: f"grad {n}: {m}")


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("per_query", [False, True])
def test_opcheck(per_query, padded):
    """The schema, the autograd registration, the fake implementations (shapes from shapes) and AOT dispatch with
    dynamic shapes. With ``grad`` the forward keeps its scores in a buffer whose entries beyond each row's reach
    are never written (nor read): its values are not compared, so AOT dispatch runs without ``grad`` (the
    backward then recomputes the scores)."""
    q, k, v, z, kpm = _inputs(per_query, padded, L=11)
    torch.library.opcheck(span_band, (q, k, v, z, kpm, 2.0, 0.5, 4, 8, False))
    torch.library.opcheck(span_band, (q, k, v, z, kpm, 2.0, 0.5, 4, 8, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    with torch.no_grad():
        out, lse, scores, *reach = span_band(q, k, v, z, kpm, 2.0, 0.5, 4, 8, True)
    assert scores.shape[:2] == (4, 11) and scores.shape[2] > 0
    g = torch.randn_like(out)
    for kept in (scores, scores[..., :0]):
        torch.library.opcheck(span_band_backward, (q.detach(), k.detach(), v.detach(), z.detach(), kpm, out, lse,
                                                   kept, *reach, g, 2.0, 0.5, 4))


def test_compiled_training_step_equals_eager():
    """torch.compile (fullgraph) of dynamic-span on numba, forward and backward: the operator and its backward in
    the graphs (the spans come out of an einsum with permuted strides; the gradient of z is contiguous, as the fake
    backward says), gradients of q, k, v and of the span predictor equal eager's."""
    torch.manual_seed(0)
    attn = attnkit.build("dynamic-span", num_heads=2, head_dim=8, max_span=20, ramp=3.0, init_span=6.0, block_size=8,
                         backend="numba").double()
    with torch.no_grad():
        attn.span_weight.normal_()
    q, k, v = (torch.randn(2, 2, 19, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: attn(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    a, b = compiled(q, k, v), attn(q, k, v, causal=True)
    torch.testing.assert_close(a, b)
    tensors = (q, k, v, attn.span_weight, attn.span_bias)
    for x, y in zip(torch.autograd.grad(a.square().sum(), tensors), torch.autograd.grad(b.square().sum(), tensors)):
        torch.testing.assert_close(x, y)
