"""Where performer's causal time goes on numba: the fused forward's block parts, a training step's kernels.

``--forward``: the fused no-grad kernel's block loop (``performer/numba_fused._fused_rows``) rebuilt here with
its three parts switched on and off, one thread, hot: the query features, the key features (each also as the
projection alone) and the causal product of the block. ``--train``: a training step of the module (L, B = 1,
H = 8, D = 64, M = 256, two threads) with every numba kernel call timed (the ``rows`` runner wrapped), the rest
reported as torch's glue.

    python plugins/attnkit-kernelized/benchmarks/profile_performer_parts.py --forward --train [--length 8192]

Nothing here is a test: figures for docs/benchmarks.md ("Session 62").
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numba
import numpy as np
import torch


def forward_parts(L: int, rounds: int) -> None:
    from attnkit.numba_panel import empty_aligned
    from attnkit_kernelized._numba import FASTMATH
    from attnkit_kernelized._tiles import causal_block_normalised
    from attnkit_kernelized._vexp import HALF, constants
    from attnkit_kernelized.performer.numba_features import _project
    from attnkit_kernelized.performer.numba_fused import _key_block, _query_block

    @numba.njit(fastmath=FASTMATH, nogil=True)
    def loop(Q, K, V, WT, pad, s2h, cst, chunk, S0, z0, out, fq, fk, fc):  # pragma: no cover - compiled
        N, L, D = Q.shape
        M = WT.shape[1]
        E = V.shape[2]
        zero = cst[HALF] - cst[HALF]
        ninf = -np.inf * cst[HALF] * 2
        xb = empty_aligned(chunk, M, Q)
        yb = empty_aligned(chunk, M, Q)
        yT = empty_aligned(M, chunk, Q)
        A = empty_aligned(chunk, chunk, Q)
        db = np.empty(chunk, dtype=Q.dtype)
        mb = np.empty(chunk, dtype=Q.dtype)
        h = np.empty(M, dtype=Q.dtype)
        xb[:] = 0.01
        yb[:] = 0.01
        low = -ninf
        for n in range(N):
            S = empty_aligned(M, E, Q)
            S[:] = S0[n]
            z = z0[n].copy()
            for j in range(M):
                h[j] = ninf
            for c0 in range(0, L, chunk):
                T = min(c0 + chunk, L) - c0
                if fq == 2:
                    _project(xb, Q[n, c0:], WT, T)
                elif fq:
                    _query_block(xb, Q[n, c0:], WT, T, mb, zero)
                if fk == 2:
                    _project(yb, K[n, c0:], WT, T)
                elif fk:
                    low = _key_block(yb, K[n, c0:], WT, T, pad[n], s2h, h, low, zero)
                if fc:
                    causal_block_normalised(xb, yb, yT, A, db, V[n], out[n], S, z, c0, T, M, E, zero)
        return low

    N, D, M, E = 4, 64, 256, 64
    g = np.random.default_rng(0)
    Q, K = (g.standard_normal((N, L, D), dtype=np.float32) for _ in range(2))
    V = g.standard_normal((N, L, E), dtype=np.float32)
    WT = np.ascontiguousarray((g.standard_normal((M, D), dtype=np.float32) * 0.35).T)
    pad = np.zeros((N, 0), dtype=np.bool_)
    S0, z0 = np.zeros((N, M, E), np.float32), np.zeros((N, M), np.float32)
    out = np.empty((N, L, E), np.float32)
    cst = constants(np.dtype(np.float32))
    parts = {"everything": (1, 1, 1), "query features": (1, 0, 0), "query projection": (2, 0, 0),
             "key features": (0, 1, 0), "key projection": (0, 2, 0), "causal product": (0, 0, 1)}
    args = (Q, K, V, WT, pad, np.float32(0.0625), cst, 32, S0, z0, out)
    for flags in parts.values():
        loop(*args, *flags)
    times = {name: [] for name in parts}
    for _ in range(rounds):
        for name, flags in parts.items():
            t0 = time.perf_counter()
            loop(*args, *flags)
            times[name].append(time.perf_counter() - t0)
    blocks = N * L / 32
    print(f"# the fused forward's block parts, one thread, float32, {N} sequences of L = {L}, D = E = 64, M = 256, "
          f"blocks of 32 (medians of {rounds})")
    for name in parts:
        m = statistics.median(times[name])
        print(f"{name:18s} {1000 * m:8.2f} ms  {1e6 * m / blocks:6.1f} us a block")


def train_parts(L: int, rounds: int) -> None:
    import attnkit
    import attnkit_kernelized._numba as nb
    import attnkit_kernelized.linear.numba_ops as lo
    import attnkit_kernelized.performer.numba_features as pf
    import attnkit_kernelized.performer.numba_fused as pfu

    acc: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    run = nb.rows

    def rows(kernel, n, *a, **kw):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        run(kernel, n, *a, **kw)
        acc[kernel.__name__] += time.perf_counter() - t0
        calls[kernel.__name__] += 1

    lo.rows = pf.rows = pfu.rows = rows
    torch.manual_seed(0)
    mod = attnkit.build("performer", num_features=256, num_heads=8, head_dim=64)
    g = torch.Generator().manual_seed(L)
    q, k, v, go = (torch.randn((1, 8, L, 64), generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> None:
        mod(q, k, v, causal=True).backward(go)

    for _ in range(3):
        step()
    acc.clear()
    calls.clear()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    mean = sum(times) / rounds
    print(f"# a training step, L = {L}, B = 1, H = 8, D = 64, M = 256, float32, {torch.get_num_threads()} threads: "
          f"mean {1000 * mean:.1f} ms, median {1000 * statistics.median(times):.1f} ms ({rounds} steps)")
    kernels = 0.0
    for name, t in sorted(acc.items(), key=lambda x: -x[1]):
        print(f"{name:22s} {1000 * t / rounds:7.1f} ms  ({calls[name] // rounds} calls a step)")
        kernels += t / rounds
    print(f"{'torch glue (the rest)':22s} {1000 * (mean - kernels):7.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forward", action="store_true")
    p.add_argument("--train", action="store_true")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if args.forward:
        forward_parts(args.length, args.rounds)
    if args.train:
        train_parts(args.length, 2 * args.rounds)


if __name__ == "__main__":
    main()
