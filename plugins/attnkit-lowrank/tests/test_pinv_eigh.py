"""``newton_pinv_sym`` (SOFT's Newton iterate from one eigendecomposition) against ``newton_pinv``.

The module runs ``newton_pinv_sym`` on CPU and its plain reference runs the
Newton products, so the kit already compares the two through SOFT; these
tests pin the pseudo-inverse itself: the same values and gradients as the
products in float64 over well- and ill-conditioned kernel matrices, repeated
points, many iterations (where a divided-difference recurrence alone would
diverge), gradcheck, and float32 accuracy; and the converged shortcut (every eigenvalue converged to
rounding, certified by a shifted Cholesky factorisation: the inverse from a Cholesky factor) taken where it
holds and not elsewhere, with the same values and gradients.
"""

from __future__ import annotations

import pytest
import torch
from attnkit_lowrank import common
from attnkit_lowrank.common import newton_pinv, newton_pinv_sym
from attnkit_lowrank.soft.naive import gauss

F64 = torch.float64


def _points(m: int, spread: float, seed: int, repeat: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 6, generator=g, dtype=F64) * spread
    if repeat:
        x = torch.cat([x, x[:repeat]])                 # repeated points: equal rows, a singular kernel matrix
    return x.requires_grad_(True)


def _kernel(x: torch.Tensor) -> torch.Tensor:
    return gauss(x, x, 0.5)


CASES = [   # (m, spread, iterations, repeated points): cond(A) from ~1 to ~1e6
    (12, 2.0, 20, 0), (24, 0.6, 20, 0), (24, 0.25, 20, 0), (24, 0.6, 0, 0), (24, 0.6, 1, 0),
    (16, 0.6, 200, 0), (10, 0.8, 20, 3),
]


@pytest.mark.parametrize("m, spread, iterations, repeat", CASES)
def test_values_and_gradients_equal_the_newton_products(m, spread, iterations, repeat):
    x = _points(m, spread, seed=m + iterations, repeat=repeat)
    w = torch.randn(x.shape[0], x.shape[0], dtype=F64, generator=torch.Generator().manual_seed(1))
    z_ref, z = newton_pinv(_kernel(x), iterations), newton_pinv_sym(_kernel(x), iterations)
    torch.testing.assert_close(z, z_ref, atol=1e-10 * z_ref.abs().max().item(), rtol=1e-9)
    g_ref, = torch.autograd.grad((z_ref * w).sum(), x)
    g, = torch.autograd.grad((z * w).sum(), x)
    torch.testing.assert_close(g, g_ref, atol=1e-9 * g_ref.abs().max().item(), rtol=1e-8)


def test_a_singular_matrix_keeps_its_null_space_over_many_iterations():
    """Repeated points: A has an exact null space. Its rounding-level eigenvalues count as zeros, so the
    iterate converges to the pseudo-inverse; without that they would double every iteration (the float64
    Newton products themselves reach ~1e20 here at 120 iterations, their rounding in the null space doubling)."""
    x = _points(10, 0.8, seed=5, repeat=3).detach()
    a = _kernel(x)
    z = newton_pinv_sym(a, 120)
    torch.testing.assert_close(z, torch.linalg.pinv(a, hermitian=True), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(newton_pinv_sym(a, 20), newton_pinv(a, 20), atol=1e-9, rtol=1e-8)


def test_many_iterations_on_spread_eigenvalues_keep_the_gradient_finite_and_right():
    """Eigenvalues far apart: the quotient branch. A recurrence for every pair diverged here (1e16 at 30 it.)."""
    x = _points(8, 1.2, seed=3)
    a = _kernel(x)
    lam = torch.linalg.eigvalsh(a.detach())
    assert lam.max() / lam.min() > 2                    # some pairs more than 2x apart
    w = torch.randn(8, 8, dtype=F64)
    for iterations in (30, 60):
        g_ref, = torch.autograd.grad((newton_pinv(_kernel(x), iterations) * w).sum(), x)
        g, = torch.autograd.grad((newton_pinv_sym(_kernel(x), iterations) * w).sum(), x)
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, g_ref, atol=1e-9 * g_ref.abs().max().item(), rtol=1e-8)


def test_gradcheck_on_a_general_matrix_and_through_the_kernel():
    a = torch.randn(2, 5, 5, dtype=F64, requires_grad=True)            # not symmetric: symmetrised inside
    assert torch.autograd.gradcheck(lambda a: newton_pinv_sym(a, 4), (a,))
    x = torch.randn(2, 6, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: newton_pinv_sym(gauss_batched(x), 7), (x,))


def gauss_batched(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.35 * ((x[..., :, None, :] - x[..., None, :, :]) ** 2).sum(-1))


def test_float32_is_at_least_as_accurate_as_the_float32_products():
    for spread in (0.1, 0.3, 1.0):                       # cond ~ 1e5, 1e3, ~1
        x = _points(64, spread, seed=7).detach()
        a = _kernel(x)
        exact = newton_pinv(a, 20)
        z32, products32 = newton_pinv_sym(a.float(), 20), newton_pinv(a.float(), 20)
        assert z32.dtype == torch.float32
        err, err_products = ((z.to(F64) - exact).norm() / exact.norm() for z in (z32, products32))
        assert err <= max(err_products, 1e-6)


def test_soft_on_cpu_runs_the_eigendecomposition(monkeypatch):
    """The module's CPU path is the eigen form (so the kit's comparison with the Newton reference covers it)."""
    import attnkit_lowrank.soft.module as soft_module

    import attnkit
    calls = []
    real = soft_module.newton_pinv_sym
    monkeypatch.setattr(soft_module, "newton_pinv_sym", lambda a, it: calls.append(it) or real(a, it))
    attn = attnkit.build("soft", head_dim=4, stride=2, pinv_iterations=5)
    q = torch.randn(1, 2, 8, 4)
    attn(q, q, torch.randn(1, 2, 8, 3))
    assert calls == [5]


def test_close_but_unequal_eigenvalues_in_a_batch():
    """Pairs within the 1e-3 relative gap (carried through the iteration) next to separated ones and an exact
    repeat, in a (2, 3) batch: gradients equal those of the Newton products in float64."""
    g = torch.Generator().manual_seed(7)
    u, _ = torch.linalg.qr(torch.randn(2, 3, 6, 6, generator=g, dtype=F64))
    lam = torch.tensor([1.0, 1.0 + 2e-5, 1.0 + 5e-4, 0.3, 0.3, 0.05], dtype=F64)
    lam = lam * torch.linspace(0.8, 1.2, 6, dtype=F64).view(2, 3, 1, 1).squeeze(-1)
    base = (u * lam.unsqueeze(-2)) @ u.transpose(-1, -2)
    base = ((base + base.transpose(-1, -2)) / 2).requires_grad_(True)
    w = torch.randn(2, 3, 6, 6, generator=g, dtype=F64)
    for iterations in (5, 20):
        z_ref, z = newton_pinv(base, iterations), newton_pinv_sym(base, iterations)
        torch.testing.assert_close(z, z_ref, atol=1e-10 * z_ref.abs().max().item(), rtol=1e-9)
        g_ref, = torch.autograd.grad((z_ref * w).sum(), base)
        g_sym, = torch.autograd.grad((z * w).sum(), base)
        # the products' gradient is not symmetric; newton_pinv_sym's is that of the symmetrised function
        g_ref = (g_ref + g_ref.transpose(-1, -2)) / 2
        torch.testing.assert_close(g_sym, g_ref, atol=1e-8 * g_ref.abs().max().item(), rtol=1e-7)


def _spy_shortcut(monkeypatch) -> list[bool]:
    taken, real = [], common._converged_inverse
    monkeypatch.setattr(common, "_converged_inverse", lambda a, c, it: taken.append((r := real(a, c, it)) is not None)
                        or r)
    return taken


def test_the_converged_shortcut_where_it_holds_and_not_elsewhere(monkeypatch):
    """Well-conditioned kernels at 20 iterations: every eigenvalue converged, the inverse from a Cholesky factor.
    One ill-conditioned matrix in the batch, or too few iterations: the eigendecomposition for all. Values and
    gradients (through the kernel, so also through the scaling c) equal the Newton products in float64."""
    taken = _spy_shortcut(monkeypatch)
    g = torch.Generator().manual_seed(11)
    well = torch.randn(3, 32, 6, generator=g, dtype=F64) * 1.5                       # cond(A) ~ 2-10
    mixed = torch.cat([well[:2], torch.randn(1, 32, 6, generator=g, dtype=F64) * 0.3])    # third: cond ~ 1e4
    for x, iterations, expect in ((well, 20, True), (mixed, 20, False), (well, 5, False), (well, 60, True)):
        x = x.clone().requires_grad_(True)
        w = torch.randn(3, 32, 32, generator=g, dtype=F64)
        z_ref, z = newton_pinv(gauss_batched(x), iterations), newton_pinv_sym(gauss_batched(x), iterations)
        assert taken[-1] is expect
        torch.testing.assert_close(z, z_ref, atol=1e-10 * z_ref.abs().max().item(), rtol=1e-9)
        g_ref, = torch.autograd.grad((z_ref * w).sum(), x)
        g_sym, = torch.autograd.grad((z * w).sum(), x)
        torch.testing.assert_close(g_sym, g_ref, atol=1e-9 * g_ref.abs().max().item(), rtol=1e-8)
    x = (torch.randn(2, 6, 3, dtype=F64) * 2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: newton_pinv_sym(gauss_batched(x), 20), (x,))
    assert taken[-1] is True
    a = gauss_batched(well.float())
    z32 = newton_pinv_sym(a, 20)
    assert taken[-1] is True and z32.dtype == torch.float32
    exact = newton_pinv(a.double(), 20)
    assert ((z32.double() - exact).norm() / exact.norm()) < 1e-6
