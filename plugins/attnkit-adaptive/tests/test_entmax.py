"""entmax: the bisection against sort-based closed forms (sparsemax, 1.5-entmax), softmax as alpha -> 1, gradients."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit_adaptive.entmax.naive import entmax_reference
from attnkit_adaptive.entmax.ops import entmax_bisect

F64 = torch.float64


def sparsemax_sort(z):
    """Martins and Astudillo 2016: sort, the support size from the cumulative sums, tau = (sum of top k - 1) / k."""
    zs, _ = z.sort(-1, descending=True)
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype)
    cs = zs.cumsum(-1)
    kz = (1 + k * zs > cs).sum(-1, keepdim=True)
    tau = (cs.gather(-1, kz - 1) - 1) / kz
    return (z - tau).clamp_min(0)


def entmax15_sort(z):
    """Peters et al. 2019: 1.5-entmax exactly by sorting (the threshold solves a quadratic per support size)."""
    x = z / 2
    xs, _ = x.sort(-1, descending=True)
    n = z.shape[-1]
    rho = torch.arange(1, n + 1, dtype=z.dtype)
    mean = xs.cumsum(-1) / rho
    mean_sq = (xs ** 2).cumsum(-1) / rho
    ss = rho * (mean_sq - mean ** 2)
    delta = (1 - ss) / rho
    tau = mean - delta.clamp_min(0).sqrt()
    support = (tau <= xs).sum(-1, keepdim=True)
    t = tau.gather(-1, support - 1)
    return (x - t).clamp_min(0) ** 2


@pytest.fixture
def scores():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 11, generator=g, dtype=F64) * 2


def test_alpha_2_is_sparsemax(scores):
    got = entmax_bisect(scores, torch.tensor(2.0, dtype=F64))
    torch.testing.assert_close(got, sparsemax_sort(scores), atol=1e-13, rtol=0)
    assert (got == 0).any()  # exact zeros


def test_alpha_1_5_matches_sort_based_entmax15(scores):
    torch.testing.assert_close(entmax_bisect(scores, torch.tensor(1.5, dtype=F64)), entmax15_sort(scores),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(entmax_reference(scores, torch.tensor(1.5, dtype=F64)), entmax15_sort(scores),
                               atol=1e-12, rtol=0)


def test_alpha_near_1_is_softmax(scores):
    got = entmax_bisect(scores, torch.tensor(1.0001, dtype=F64))
    torch.testing.assert_close(got, scores.softmax(-1), atol=5e-4, rtol=0)


@pytest.mark.parametrize("alpha", [1.0001, 1.3, 2.0, 3.0])
def test_rows_sum_to_one_and_masked_pairs_are_zero(scores, alpha):
    s = scores.clone()
    s[0, 0, :5] = float("-inf")
    s[1, 2, :] = float("-inf")
    p = entmax_bisect(s, torch.tensor(alpha, dtype=F64))
    sums = p.sum(-1)
    want = torch.ones_like(sums)
    want[1, 2] = 0.0  # a fully masked row is 0, never NaN
    torch.testing.assert_close(sums, want, atol=1e-12, rtol=0)
    assert (p[0, 0, :5] == 0).all() and (p >= 0).all()


def test_gradcheck_scores_and_alpha():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 6, generator=g, dtype=F64, requires_grad=True)
    a = torch.tensor([[1.2], [1.6], [2.4]], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z, a: entmax_bisect(z, a), (z, a))
    assert torch.autograd.gradcheck(lambda z, a: entmax_reference(z, a), (z, a))


def test_module_fast_path_equals_reference_incl_alpha_grad(qkv):
    from attnkit.masks import causal
    from attnkit_adaptive.entmax.naive import reference

    attn = attnkit.build("entmax", num_heads=2, alpha=[1.3, 2.2]).double()
    q, k, v = qkv(10, grad=True)
    out = attn(q, k, v, causal=True)
    ref = reference(attn, q, k, v, mask=causal())
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    w = torch.randn_like(out)
    ga = torch.autograd.grad((out * w).sum(), (q, k, v, attn.alpha))
    gb = torch.autograd.grad((ref * w).sum(), (q, k, v, attn.alpha))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)
    assert ga[3].abs().min() > 0  # alpha learns, per head


def test_fixed_alpha_is_a_buffer():
    attn = attnkit.build("entmax", num_heads=2, alpha=2.0, learn_alpha=False)
    assert list(attn.parameters()) == [] and "alpha" in attn.state_dict()


def test_entmax_attention_is_sparse(qkv):
    attn = attnkit.build("entmax", num_heads=2, alpha=2.0).double()
    q, k, v = qkv(16)
    eye = torch.eye(16, dtype=F64).expand(2, 2, 16, 16)
    w = attn(q * 3, k, eye)  # values = identity: the output is the weight matrix
    assert (w == 0).float().mean() > 0.3
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 16, dtype=F64))


def test_an_exported_program_holds_the_bisection_as_one_operator():
    """While exporting, the threshold's bisection is one custom operator (unrolled, its 32-60 steps made
    programs of hundreds of nodes that took seconds to trace); the program equals eager, and the operator
    passes torch.library's checks (fake shapes, dispatch)."""
    import warnings

    from attnkit_adaptive.entmax.ops import entmax_threshold

    g = torch.Generator().manual_seed(0)
    for alpha in (torch.tensor(1.5, dtype=F64), torch.full((1, 3, 1, 1), 1.7, dtype=F64)):
        xd = torch.randn(2, 3, 5, 7, generator=g, dtype=F64)
        xd[0, 0, 0, :3] = float("-inf")
        mx = xd.amax(-1, keepdim=True)
        torch.library.opcheck(entmax_threshold, (xd, mx, alpha - 1, 1 / (alpha - 1), 60))

    class Call(torch.nn.Module):
        def forward(self, s, a):
            return entmax_bisect(s, a)

    s = torch.randn(2, 3, 6, 9, generator=g)
    a = torch.tensor(1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(Call(), (s, a))
    targets = [str(n.target) for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"]   # (the bisection sits in a no-grad submodule)
    assert any("entmax_threshold" in t for t in targets) and len(targets) < 100, targets   # (unrolled: over 250)
    torch.testing.assert_close(ep.module()(s, a), entmax_bisect(s, a))
