"""Exact softmax: fp64 reference, SDPA == naive, masks, streaming through a KV cache."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.builtin import SOFTMAX
from attnkit.reference import reference_attention
from attnkit.softmax import SoftmaxAttention


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def qkv(B=2, H=3, L=9, S=9, D=8, E=5, dtype=torch.float32):
    return rand(B, H, L, D, dtype=dtype, seed=1), rand(B, H, S, D, dtype=dtype, seed=2), \
        rand(B, H, S, E, dtype=dtype, seed=3)


def padding(B, S, lengths):
    return torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "padding": {"key_padding_mask": padding(2, 9, [9, 4])},
    "causal+padding": {"causal": True, "key_padding_mask": padding(2, 9, [6, 9])},
    "bool mask": {"attn_mask": rand(1, 3, 9, 9, seed=7) > 0},
    "float mask": {"attn_mask": rand(2, 1, 9, 9, seed=8)},
}


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(backend, case):
    q, k, v = qkv()
    kw = CASES[case]
    out = attnkit.build("softmax", backend=backend)(q, k, v, **kw)
    ref = reference_attention(q, k, v, **kw)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 9, 5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_path_equals_naive_path(case):
    q, k, v = qkv(dtype=torch.float64)
    kw = CASES[case]
    a = attnkit.build("softmax", backend="sdpa")(q, k, v, **kw)
    b = attnkit.build("softmax", backend="torch")(q, k, v, **kw)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_reference_is_not_trivially_equal():
    """The comparison above can fail: causal and plain differ."""
    q, k, v = qkv()
    assert not torch.allclose(reference_attention(q, k, v), reference_attention(q, k, v, causal=True))


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_fully_masked_rows_are_zero_with_finite_grads(backend):
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.float64))
    kpm = padding(2, 9, [0, 5])  # batch 0 has no real key at all
    mask = torch.ones(9, 9, dtype=torch.bool)
    mask[3] = False  # query row 3 sees nothing
    out = attnkit.build("softmax", backend=backend)(q, k, v, key_padding_mask=kpm, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[1, :, 3] == 0).all()
    assert (out[1, :, 2] != 0).any()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_float_mask_with_neg_inf_row_gives_zero():
    q, k, v = qkv()
    m = torch.zeros(9, 9)
    m[0] = float("-inf")
    out = attnkit.build("softmax")(q, k, v, attn_mask=m)
    assert (out[:, :, 0] == 0).all() and torch.isfinite(out).all()


def test_cross_attention_and_bottom_right_causal():
    q, k, v = qkv(L=4, S=9)
    attn = attnkit.build("softmax")
    torch.testing.assert_close(attn(q, k, v).double(), reference_attention(q, k, v), atol=1e-5, rtol=0)
    out = attn(q, k, v, causal=True)
    # the last query sits at position 8 and sees every key: equals unmasked attention for that row
    torch.testing.assert_close(out[:, :, -1], attn(q, k, v)[:, :, -1])
    # the first query sits at position 5 and sees keys 0..5
    full = attn(q[:, :, :1], k[:, :, :6], v[:, :, :6])
    torch.testing.assert_close(out[:, :, :1], full)


@pytest.mark.parametrize("chunk", [1, 7, 23])
def test_streaming_equals_causal_forward(chunk):
    q, k, v = qkv(L=23, S=23)
    attn = attnkit.build("softmax")
    state = attn.init_state(2)
    outs = []
    for t in range(0, 23, chunk):
        o, state = attn.step(q[:, :, t:t + chunk], k[:, :, t:t + chunk], v[:, :, t:t + chunk], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=2), attn(q, k, v, causal=True), atol=1e-6, rtol=1e-5)
    assert state.data["k"].shape == (2, 3, 23, 8)


def test_step_rejects_a_foreign_state_and_wrong_batch():
    attn = attnkit.build("softmax")
    q, k, v = qkv(L=2, S=2)
    with pytest.raises(attnkit.InvalidInputError, match="state must come from init_state"):
        attn.step(q, k, v, state=[1, 2])
    with pytest.raises(attnkit.InvalidInputError, match="state was made for batch size 5"):
        attn.step(q, k, v, attn.init_state(5))
    with pytest.raises(attnkit.InvalidInputError, match="state is None"):
        attn.step(q, k, v, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    q, k, v = qkv(dtype=dtype)
    out = attnkit.build("softmax")(q, k, v, causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, causal=True), atol=2e-2, rtol=0)


def test_dropout_only_in_training():
    q, k, v = qkv()
    attn = attnkit.build("softmax", dropout=0.5)
    attn.eval()
    torch.testing.assert_close(attn(q, k, v), attnkit.build("softmax")(q, k, v))
    attn.train()
    torch.manual_seed(0)
    assert not torch.allclose(attn(q, k, v), attnkit.build("softmax")(q, k, v))
    torch_path = attnkit.build("softmax", dropout=0.5, backend="torch").train()
    assert not torch.allclose(torch_path(q, k, v), attnkit.build("softmax")(q, k, v))


def test_gradcheck_float64():
    q, k, v = (t.requires_grad_() for t in qkv(B=1, H=1, L=4, S=4, D=3, E=2, dtype=torch.float64))
    kpm = padding(1, 4, [3])
    for backend in ("sdpa", "torch"):
        attn = attnkit.build("softmax", backend=backend)
        assert torch.autograd.gradcheck(
            lambda a, b, c, attn=attn: attn(a, b, c, causal=True, key_padding_mask=kpm), (q, k, v)
        )


def test_env_backend_forces_and_bad_backend_is_refused(monkeypatch):
    q, k, v = qkv()
    attn = attnkit.build("softmax")
    assert attn.resolve_backend(q) == "sdpa"
    monkeypatch.setenv("ATTNKIT_BACKEND", "torch")
    assert attn.resolve_backend(q) == "torch"
    monkeypatch.setenv("ATTNKIT_BACKEND", "numba")  # not offered by softmax: auto
    assert attn.resolve_backend(q) == "sdpa"
    with pytest.raises(attnkit.InvalidInputError, match=r"offers backends \['sdpa', 'torch'\]"):
        attnkit.build("softmax", backend="triton")(q, k, v)


class _Float64PrefersTorch(SoftmaxAttention):
    """softmax with a dtype-dependent auto order: torch first for float64, the declared order otherwise."""

    capabilities = SOFTMAX.capabilities                    # unregistered: the built-in's backends ("sdpa", "torch")

    def backend_order(self, device, dtype):
        return ("torch", "nonexistent") if dtype == torch.float64 else super().backend_order(device, dtype)


def test_backend_order_depends_on_dtype_and_yields_to_forcing(monkeypatch):
    attn = _Float64PrefersTorch()
    assert attn.backend_order(torch.device("cpu"), torch.float32) == ("sdpa", "torch")
    q32 = qkv()[0]
    q64 = q32.double()
    assert attn.resolve_backend(q32) == "sdpa"
    assert attn.resolve_backend(q64) == "torch"            # the override, a name it does not offer ignored
    assert attn._backend_while_compiling(q64.device, False, q64.dtype) == "torch"
    assert attn._auto_order(q64.device, q64.dtype) == ("torch", "sdpa")   # unnamed offered backends follow
    monkeypatch.setenv("ATTNKIT_BACKEND", "sdpa")          # the environment still forces
    assert attn.resolve_backend(q64) == "sdpa"
    monkeypatch.delenv("ATTNKIT_BACKEND")
    forced = _Float64PrefersTorch(backend="sdpa")          # and so does backend=
    assert forced.resolve_backend(q64) == "sdpa"
    q, k, v = (t.double() for t in qkv())
    torch.testing.assert_close(attn(q, k, v), forced(q, k, v))


def test_sdpa_path_with_padding_compiles_to_one_graph_and_zeroes_a_fully_padded_row():
    """``torch.compile(fullgraph=True)`` of the sdpa path with a key padding mask: the check for fully padded rows
    branched on the mask's values (a graph break; an error with ``fullgraph=True``); compiled, the path takes
    the branch-free form, equal to eager, a fully padded row still zero with finite gradients."""
    import torch._dynamo

    torch._dynamo.reset()
    attn = attnkit.build("softmax", backend="sdpa")
    compiled = torch.compile(attn, backend="eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    kpm = torch.ones(2, 6, dtype=torch.bool)
    kpm[1] = False
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = compiled(*xs, key_padding_mask=kpm)
    out.sum().backward()
    torch.testing.assert_close(out, attn(q, k, v, key_padding_mask=kpm), rtol=0, atol=1e-6)
    assert out[1].abs().max() == 0
    assert all(torch.isfinite(x.grad).all() for x in xs)


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_a_float_attn_mask_compiles_to_one_graph_and_the_graph_refuses_nan(backend):
    """A float ``attn_mask`` under ``torch.compile(fullgraph=True)``: the NaN / +inf check and the ``-inf`` split
    branched on its values; compiled they are graph ops (the general form for masks with and without ``-inf``,
    equal to eager; NaN raises when the graph runs, with eager's message)."""
    import torch._dynamo

    torch._dynamo.reset()
    attn = attnkit.build("softmax", backend=backend)
    compiled = torch.compile(attn, backend="eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    finite = torch.randn(2, 1, 6, 6, generator=g)
    with_inf = finite.masked_fill(torch.rand(2, 1, 6, 6, generator=g) < 0.3, float("-inf"))
    for mask in (finite, with_inf):
        torch.testing.assert_close(compiled(q, k, v, attn_mask=mask), attn(q, k, v, attn_mask=mask),
                                   rtol=0, atol=1e-6)
    bad = finite.clone()
    bad[0, 0, 2, 3] = float("nan")
    with pytest.raises(RuntimeError, match="attn_mask.*NaN or \\+inf"):
        compiled(q, k, v, attn_mask=bad)
