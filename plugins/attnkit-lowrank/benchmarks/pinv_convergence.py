"""Error per iteration of the two iterative pseudo-inverses against torch.linalg.pinv (float64).

The matrices are the ones the mechanisms invert, on Gaussian inputs
(q, k ~ N(0, std^2), D = 64, L = 4096, 64 landmarks / bottleneck tokens):

* ``nystrom``: ``A = softmax(Q~ K~^T / sqrt(D))`` (segment-mean landmarks);
* ``soft``: ``A = exp(-|k~_i - k~_j|^2 / (2 sqrt(D)))`` (average-pooled bottleneck tokens).

Prints a markdown table with the condition number of A and, at each iteration t, the
relative Frobenius error ``|Z_t - pinv(A)| / |pinv(A)|`` and the Penrose residual
``|A Z_t A - A| / |A|`` (what the approximation ``F Z G`` depends on: directions of tiny
singular values dominate the first, barely matter in the second). Run:
``python benchmarks/pinv_convergence.py > benchmarks/results/pinv_convergence.md``.
"""

from __future__ import annotations

import torch
from attnkit_lowrank.common import newton_pinv, nystrom_pinv
from attnkit_lowrank.soft.module import gaussian_kernel

L, D, M = 4096, 64, 64


def matrices():
    for std in (0.5, 1.0, 2.0):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(L, D, generator=g, dtype=torch.float64) * std
        k = torch.randn(L, D, generator=g, dtype=torch.float64) * std
        ql, kl = q.view(M, L // M, D).mean(1), k.view(M, L // M, D).mean(1)
        a = torch.softmax(ql @ kl.T / D ** 0.5, -1)
        yield "nystrom", std, a, nystrom_pinv, (0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20)
        # SOFT with single keys as tokens (stride 1) and with window means (stride 64)
        yield "soft", std, gaussian_kernel(k[:M], k[:M], D ** -0.5), newton_pinv, (0, 2, 4, 6, 8, 10, 12, 15, 20, 30)
        a = gaussian_kernel(kl, kl, D ** -0.5)
        yield "soft (pooled tokens)", std, a, newton_pinv, (0, 2, 4, 6, 8, 10, 15, 20, 30)


def main() -> None:
    print("| matrix | input std | cond(A) | t: pinv error / Penrose residual |")
    print("|---|---|---|---|")
    for name, std, a, fn, its in matrices():
        p = torch.linalg.pinv(a)
        cells = []
        for t in its:
            z = fn(a, t)
            cells.append(f"{t}: {((z - p).norm() / p.norm()).item():.1e} / "
                         f"{((a @ z @ a - a).norm() / a.norm()).item():.1e}")
        print(f"| {name} | {std} | {torch.linalg.cond(a).item():.3g} | {', '.join(cells)} |")


if __name__ == "__main__":
    main()
