"""torch.export of the sparse mechanisms beyond the kit's check: what a program holds, and loading it elsewhere."""

from __future__ import annotations

import importlib
import io
import subprocess
import sys
import warnings

import pytest
import torch

import attnkit


class _Call(torch.nn.Module):
    def __init__(self, attn, causal=True):
        super().__init__()
        self.attn, self.causal = attn, causal

    def forward(self, q, k, v, kpm):
        return self.attn(q, k, v, causal=self.causal, key_padding_mask=kpm)


class _Plain(torch.nn.Module):
    def __init__(self, attn, causal=True):
        super().__init__()
        self.attn, self.causal = attn, causal

    def forward(self, q, k, v):
        return self.attn(q, k, v, causal=self.causal)


def _inputs(seed=0, L=40):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, L, 8, generator=g) for _ in range(3))
    kpm = torch.ones(2, L, dtype=torch.bool)
    kpm[1, L - 1 - seed:] = False
    return q, k, v, kpm


def _export(module, args):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, args)


def _ops(program):
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def test_auto_exports_the_numba_operator_and_the_torch_backend_only_aten():
    q, k, v, _ = _inputs()

    class NoMask(torch.nn.Module):
        def __init__(self, backend):
            super().__init__()
            self.attn = attnkit.build("local", window=8, backend=backend, num_heads=2, head_dim=8).eval()

        def forward(self, q, k, v):
            return self.attn(q, k, v, causal=True)

    auto, plain = _ops(_export(NoMask("auto"), (q, k, v))), _ops(_export(NoMask("torch"), (q, k, v)))
    assert any("attnkit_sparse.numba_block_attention" in o for o in auto)
    assert not any("attnkit" in o for o in plain)


def test_a_key_padding_input_runs_the_torch_path_with_the_pattern_plan_on_numba_too():
    for backend in ("auto", "torch"):
        m = _Call(attnkit.build("bigbird", block_size=8, backend=backend, num_heads=2, head_dim=8).eval(), False)
        program = _export(m, _inputs()).module()
        with torch.no_grad():
            for seed in (0, 3, 7):     # other paddings than the example's: nothing of it is baked in
                args = _inputs(seed)
                torch.testing.assert_close(program(*args), m(*args), rtol=0, atol=1e-6)


_LOAD = """
import io, sys, torch
program = torch.export.load(io.BytesIO(sys.stdin.buffer.read())).module()
q, k, v, kpm, want = torch.load("{io}")
got = program(q, k, v, kpm)
assert not [m for m in sys.modules if m.startswith("attnkit")], "attnkit was imported"
print((got - want).abs().max().item())
"""


@pytest.mark.parametrize("name", ["local", "lsh"])
def test_a_torch_backend_program_loads_and_runs_where_attnkit_is_not_imported(name, tmp_path):
    opts = {"window": 8} if name == "local" else {"bucket_size": 8}
    m = _Call(attnkit.build(name, backend="torch", num_heads=2, head_dim=8, **opts).eval(), causal=name == "local")
    if name == "lsh":   # lsh takes no key padding input in a program (export_masks=()): the module holds one
        m.forward = lambda q, k, v, kpm: m.attn(q, k, v)
    buf = io.BytesIO()
    torch.export.save(_export(m, _inputs()), buf)
    args = _inputs(5)
    with torch.no_grad():
        torch.save((*args, m(*args)), tmp_path / "io.pt")
    out = subprocess.run([sys.executable, "-c", _LOAD.format(io=tmp_path / "io.pt")], input=buf.getvalue(),
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()
    assert float(out.stdout.decode().split()[-1]) < 1e-6


def test_position_tensors_among_the_inputs_are_refused_clearly():
    attn = attnkit.build("local", window=4, num_heads=2, head_dim=8).eval()

    class WithPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = attn

        def forward(self, q, k, v, pos):
            return self.attn(q, k, v, causal=True, positions=pos)

    q, k, v, _ = _inputs(L=16)
    pos = torch.arange(16).expand(2, 16).contiguous()
    with pytest.raises(attnkit.InvalidInputError, match=r"positions: position tensors among the inputs of "
                                                        r"torch\.export"):
        _export(WithPositions(), (q, k, v, pos))


@pytest.mark.parametrize("name,causal", [("block-sparse", False), ("local", True), ("sinkhorn", True)])
def test_caches_filled_under_a_func_transform_keep_no_wrapper(name, causal):
    """A call under ``torch.func.grad`` builds its plans from the transform's wrapper tensors, which outlive it
    without storage: kept in a cache (the plan of an unmasked call is shared by every module, a pattern's is
    kept on its mask, sinkhorn's on the module), a later call that reads their memory failed (found in the
    kit's export check after its func_transforms check: "Cannot access storage of TensorWrapper" on save).
    Now nothing built under a transform is kept: the same module, and a fresh one, then run on numba and their
    programs save."""
    plans = importlib.import_module("attnkit_sparse.engine.plan")   # (the module: its caches)
    plans._UNMASKED.clear()
    plans._PLANS.clear()
    attn = attnkit.build(name, num_heads=2, head_dim=8).double().eval()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    dq = torch.func.grad(lambda a: attn(a, k, v, causal=causal).sum())(q)
    assert torch.isfinite(dq).all()
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    kept = [t for p in list(plans._UNMASKED.values()) + [p for d in plans._PLANS.values() for p in d.values()]
            for t in vars(p).values() if isinstance(t, torch.Tensor)]
    kept += [t for p in attn.__dict__.get("_plans", {}).values() for t in vars(p).values()
             if isinstance(t, torch.Tensor)]
    assert not any(wrapped(t) for t in kept)
    for module in (attn, attnkit.build(name, num_heads=2, head_dim=8).double().eval()):
        want = module(q, k, v, causal=causal)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(_Plain(module, causal), (q, k, v))
        buf = io.BytesIO()
        torch.export.save(ep, buf)
        torch.testing.assert_close(ep.module()(q, k, v), want)


@pytest.mark.parametrize("name,causal", [("local", True), ("bigbird", False), ("block-sparse", False)])
def test_per_sample_gradients_with_each_sample_s_masks_equal_a_loop(name, causal):
    """``vmap(grad(...))`` over the batch with each sample's key padding mask and attn_mask (per-sample gradients,
    as DP-SGD takes them): a plan cannot be read from masks batched by vmap (``nonzero`` raised inside vmap); the
    engine then evaluates them at the gathered pairs of the pattern's plan. Equal to one autograd call per sample,
    float64."""
    from torch.func import grad, vmap

    attn = attnkit.build(name, num_heads=2, head_dim=8).double().eval()
    g = torch.Generator().manual_seed(3)
    B, L = 3, 40
    q, k, v = (torch.randn(B, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[1, 30:] = False
    kpm[2, :7] = False
    am = torch.rand(B, L, L, generator=g) > 0.3
    am |= torch.eye(L, dtype=torch.bool)

    def loss(a, b, d, m, keep):
        out = attn(a[None], b[None], d[None], causal=causal, key_padding_mask=m[None], attn_mask=keep)
        return out.square().sum()

    got = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v, kpm, am)
    for i in range(B):
        x = [t[i].clone().requires_grad_(True) for t in (q, k, v)]
        want = torch.autograd.grad(loss(*x, kpm[i], am[i]), x)
        for a, b in zip(got, want):
            torch.testing.assert_close(a[i], b)
