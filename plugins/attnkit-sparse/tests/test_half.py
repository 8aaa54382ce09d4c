"""Half precision (float16, bfloat16) on the module path: output and gradients in the input dtype, close to float64.

For a few representative modules (causal ``local``, ``bigbird``, a user's mask function on ``block-sparse``,
``lsh``) on the CPU backends (``torch``: float32 from the gather on; ``numba``: float32 copies): the output
has the input dtype and is close to the same module evaluated in float64 on the half inputs upcast (the kit's
half tolerances), the gradients of q, k, v exist in the input dtype and are close to the float64 ones; a
fully masked row is 0 (never NaN); the additive ``attn_mask`` path, poisoned padded keys, streaming and the
content-based modules' float32 state also hold. The ``triton`` tests run the module path in the interpreter
(``TRITON_INTERPRET=1``, marker ``triton``).
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.testing import DEFAULT_ATOL, DEFAULT_RTOL

HALF = [torch.float16, torch.bfloat16]
#: gradients of half inputs: max |g - g64| / max(1, |g64|max) (products and the backward's operands are rounded)
GRAD_TOL = {torch.float16: 1e-2, torch.bfloat16: 6e-2}
CPU_BACKENDS = ["torch", "numba"] if importlib.util.find_spec("numba") else ["torch"]


def _name(dt: torch.dtype) -> str:
    return str(dt).split(".")[-1]


def _stripes(b, h, q, kv):
    """A user's pattern: the diagonal band of 2 and every third key before the query."""
    return ((q - kv).abs() <= 1) | ((kv < q) & (kv % 3 == 0))


USER_MASK = masks.from_function(_stripes, name="stripes")

#: name -> (build options, forward kwargs, L)
MODULES = {
    "local_causal": ("local", {"window": 5}, {"causal": True}, 19),
    "bigbird": ("bigbird", {"block_size": 2, "num_random": 1, "num_global": 1, "num_window": 3, "seed": 1}, {}, 18),
    "block_sparse_user_mask": ("block-sparse", {}, {"mask": USER_MASK}, 21),
    "lsh": ("lsh", {"bucket_size": 4, "n_hashes": 2, "seed": 3}, {}, 17),
}


def _inputs(L, dt, *, B=2, H=2, D=8, E=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, n, generator=g, dtype=torch.float64).to(dt) for n in (D, D, E)]


def _close(actual, expected, dt, what, factor=1.0):
    atol, rtol = DEFAULT_ATOL[_name(dt)] * factor, DEFAULT_RTOL[_name(dt)] * factor
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = (a - e).abs() - (atol + rtol * e.abs())
    assert bool((err <= 0).all()), f"{what}: max |diff| {float((a - e).abs().max()):.3g} ({_name(dt)})"


def _grad_close(g, g64, dt, what):
    assert g is not None and g.dtype == dt, f"{what}: gradient {None if g is None else g.dtype}, expected {dt}"
    rel = float((g.double() - g64).abs().max()) / max(1.0, float(g64.abs().max()))
    assert rel <= GRAD_TOL[dt], f"{what}: gradient error {rel:.3g} > {GRAD_TOL[dt]} ({_name(dt)})"


def _run(mod, q, k, v, kw, shared_qk):
    return mod(q, q, v, **kw) if shared_qk else mod(q, k, v, **kw)


def _agree(module, backend, dt):
    name, opts, kw, L = MODULES[module]
    mod = attnkit.build(name, backend=backend, **opts).eval()
    shared = name == "lsh"
    mod_h, mod64 = copy.deepcopy(mod).to(dt), copy.deepcopy(mod).to(torch.float64)
    q, k, v = (t.requires_grad_() for t in _inputs(L, dt))
    out = _run(mod_h, q, k, v, kw, shared)
    assert out.dtype == dt, f"output {out.dtype} for {dt} input"
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))   # the half values, upcast
    ref = _run(mod64, q64, k64, v64, kw, shared)
    _close(out, ref, dt, f"{module} {backend} output")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, v) if shared else (q, k, v), g.to(dt))
    grads64 = torch.autograd.grad(ref, (q64, v64) if shared else (q64, k64, v64), g)
    for n, a, b in zip("qv" if shared else "qkv", grads, grads64):
        _grad_close(a, b, dt, f"{module} {backend} d{n}")


@pytest.mark.parametrize("dt", HALF, ids=_name)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("module", list(MODULES))
def test_half_output_and_gradients_match_float64(module, backend, dt):
    _agree(module, backend, dt)


@pytest.mark.parametrize("dt", HALF, ids=_name)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["local", "bigbird", "lsh"])
def test_fully_masked_rows_are_zero_in_half(name, backend, dt):
    opts = {"local": {"window": 3}, "bigbird": {"block_size": 2, "num_window": 3, "seed": 1},
            "lsh": {"bucket_size": 4, "n_hashes": 2}}[name]
    mod = attnkit.build(name, backend=backend, **opts).to(dt)
    q, k, v = (t.requires_grad_() for t in _inputs(12, dt))
    kpm = torch.ones(2, 12, dtype=torch.bool)
    kpm[1] = False                                          # batch element 1: no key at all
    out = mod(q, q if name == "lsh" else k, v, key_padding_mask=kpm)
    assert out.dtype == dt
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    out.float().sum().backward()
    for t in (q, v):
        assert t.grad.dtype == dt and torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dt", HALF, ids=_name)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_poisoned_padded_keys_have_no_influence_in_half(backend, dt):
    mod = attnkit.build("local", window=4, backend=backend).to(dt)
    q, k, v = _inputs(13, dt)
    kpm = torch.ones(2, 13, dtype=torch.bool)
    kpm[0, 3] = kpm[1, 10:] = False
    clean = mod(q, k, v, key_padding_mask=kpm)
    k2, v2 = k.clone(), v.clone()
    for t, bad in ((k2, float("nan")), (v2, float("inf"))):
        t[~kpm[:, None, :, None].expand_as(t)] = bad
    assert torch.equal(mod(q, k2, v2, key_padding_mask=kpm), clean)


@pytest.mark.parametrize("dt", HALF, ids=_name)
def test_additive_attn_mask_in_half(dt):
    mod = attnkit.build("local", window=4)
    q, k, v = _inputs(11, dt)
    bias = torch.randn(11, 11, generator=torch.Generator().manual_seed(3)).to(dt)
    bias[2] = float("-inf")                                 # a fully masked row: 0, not NaN
    out = mod.to(dt)(q, k, v, attn_mask=bias)
    assert out.dtype == dt
    ref = copy.deepcopy(mod).double()(q.double(), k.double(), v.double(), attn_mask=bias.double())
    _close(out, ref, dt, "additive attn_mask")
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))


@pytest.mark.parametrize("dt", HALF, ids=_name)
@pytest.mark.parametrize("name,opts", [("local", {"window": 4}), ("dilated", {"window": 3, "dilation": 2}),
                                       ("strided", {"stride": 3}), ("fixed", {"stride": 4, "c": 1})])
def test_streaming_in_half(name, opts, dt):
    mod = attnkit.build(name, **opts).to(dt)
    q, k, v = _inputs(14, dt)
    full = mod(q, k, v, causal=True)
    state, outs = None, []
    for s in range(0, 14, 3):
        o, state = mod(q[:, :, s:s + 3], k[:, :, s:s + 3], v[:, :, s:s + 3], causal=True, state=state,
                       return_state=True)
        assert o.dtype == dt
        outs.append(o)
    _close(torch.cat(outs, 2), full, dt, f"{name} streaming")


def test_routing_centroids_stay_float32_and_train_in_half():
    mod = attnkit.build("routing", num_clusters=3, num_heads=2, head_dim=8, seed=2, backend="torch")
    c32 = mod.centroids.clone()
    mod = mod.to(torch.bfloat16)
    assert mod.centroids.dtype == torch.float32 and torch.equal(mod.centroids, c32)
    assert mod.double().centroids.dtype == torch.float64      # float64 still converts them
    mod = mod.float().train()
    q, k, v = (t.requires_grad_() for t in _inputs(12, torch.bfloat16))
    out = mod(q, k, v)
    assert out.dtype == torch.bfloat16 and mod.centroids.dtype == torch.float32
    assert not torch.equal(mod.centroids, c32)              # the EMA moved them
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dt", HALF, ids=_name)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name,opts", [("routing", {"num_clusters": 3, "seed": 2}),
                                       ("sinkhorn", {"block_size": 4, "sinkhorn_iters": 3, "head_dim": 8})])
def test_content_modules_in_half_match_float64(name, opts, backend, dt):
    mod = attnkit.build(name, backend=backend, **opts).eval()
    q, k, v = _inputs(16, dt)
    out = copy.deepcopy(mod).to(dt)(q, k, v, causal=True)
    assert out.dtype == dt
    ref = copy.deepcopy(mod).double()(q.double(), k.double(), v.double(), causal=True)
    _close(out, ref, dt, f"{name} {backend}", factor=2.0)


# ------------------------------------------------------------------------------------ triton (interpreter)
_interp = pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                             reason="needs triton and TRITON_INTERPRET=1 set before the run")


@pytest.mark.triton
@_interp
@pytest.mark.parametrize("module", ["local_causal", "bigbird", "block_sparse_user_mask"])
def test_triton_module_path_float16(module, monkeypatch):
    """Half operands reach the triton kernels as they are (the interpreter runs float16 dots correctly)."""
    from attnkit_sparse.engine import triton_ops

    seen, real = [], triton_ops.attend

    def spy(q, k, v, *args, **kw):
        seen.append(q.dtype)
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(triton_ops, "attend", spy)
    _agree(module, "triton", torch.float16)
    assert torch.float16 in seen, f"the module path reached the triton kernels with {seen}, not float16"


@pytest.mark.triton
@_interp
@pytest.mark.parametrize("name,opts,shared", [("local", {"window": 5, "block_size": 16}, False),
                                              ("lsh", {"bucket_size": 16, "n_hashes": 2}, True)])
def test_triton_module_path_bfloat16_dtypes(name, opts, shared):
    """bfloat16 on the module path: the dtypes (the interpreter widens bfloat16 products to float32)."""
    opts = {k: v for k, v in opts.items() if k != "block_size"}
    mod = attnkit.build(name, backend="triton", **opts).to(torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in _inputs(32, torch.bfloat16, D=16, E=16))
    out = mod(q, q if shared else k, v, causal=name == "local")
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    for t in (q, v) if shared else (q, k, v):
        assert t.grad is not None and t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all()


@pytest.mark.triton
@_interp
@pytest.mark.parametrize("name,opts,L,shared", [
    ("lsh", {"bucket_size": 16, "n_hashes": 2, "seed": 3}, 40, True),
    ("routing", {"num_clusters": 4, "num_heads": 2, "head_dim": 8}, 64, False),
    ("sinkhorn", {"block_size": 16, "num_heads": 2, "head_dim": 8}, 64, False),
])
def test_triton_content_modules_float16(name, opts, L, shared, monkeypatch):
    """Content-based modules on triton in float16: float32 hashing/routing/sorting, half operands to the kernels
    (seen by a spy), the output and gradients in float16 and close to the same module in float64 on torch."""
    from attnkit_sparse.engine import triton_ops

    seen, real = [], triton_ops.attend
    monkeypatch.setattr(triton_ops, "attend", lambda q, *a, **kw: seen.append(q.dtype) or real(q, *a, **kw))
    torch.manual_seed(0)
    tri = attnkit.build(name, backend="triton", **opts).eval()
    ref = attnkit.build(name, backend="torch", **opts).double().eval()
    ref.load_state_dict(tri.state_dict())
    dt = torch.float16
    tri = tri.to(dt)
    q, k, v = (t.requires_grad_() for t in _inputs(L, dt))
    kx = q if shared else k
    out = tri(q, kx, v, causal=True)
    assert out.dtype == dt and seen and all(d == dt for d in seen), seen
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = ref(q64, q64 if shared else k64, v64, causal=True)
    _close(out, want, dt, f"{name} triton float16", factor=2.0)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    leaves, leaves64 = ((q, v), (q64, v64)) if shared else ((q, k, v), (q64, k64, v64))
    for n, a, b in zip("qv" if shared else "qkv", torch.autograd.grad(out, leaves, g.to(dt)),
                       torch.autograd.grad(want, leaves64, g)):
        _grad_close(a, b, dt, f"{name} triton d{n}")
