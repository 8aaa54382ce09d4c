"""Time ``fast-weight``'s parts below the module: the numba forward and backward kernels, the torch form's
``delta_rule`` and the DPFP feature map, on fixed inputs (CPU, float32).

* ``numba-fwd`` / ``numba-bwd``: ``_delta_chunked`` / ``_delta_chunked_backward`` of
  :mod:`attnkit_kernelized.fast_weight.numba_ops` on ``--seqs`` sequences of ``--length`` positions,
  M = 128 features, E = 64, checkpoints every 64, one thread (the kernels' own range: no thread pool);
* ``fused-fwd``: :func:`attnkit_kernelized.fast_weight.numba_fused.fused_causal` (DPFP of ``(1, seqs, length,
  64)`` q and k and the delta rule in one kernel, on ``--threads`` threads);
* ``torch-fwd``: :func:`attnkit_kernelized.fast_weight.chunk.delta_rule` under ``no_grad``, B = 1, H =
  ``--seqs``, chunk ``--chunk``;
* ``dpfp``: :func:`attnkit_kernelized.feature_maps.dpfp_feature_map` then the sum normalisation on a
  ``(1, seqs, length, 64)`` tensor.

Median of ``--repeats`` calls after one warm-up. To time another revision's code, run this file with
``PYTHONPATH`` pointing at that revision's ``packages/attnkit/src`` and ``plugins/attnkit-kernelized/src``.
Nothing here is a test.

Usage::

    flock /tmp/attnkit-bench.lock python plugins/attnkit-kernelized/benchmarks/bench_fast_weight_kernels.py \\
        --threads 1 --length 2048 --seqs 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch

import attnkit_kernelized
from attnkit_kernelized.fast_weight import chunk
from attnkit_kernelized.fast_weight.numba_fused import fused_causal
from attnkit_kernelized.fast_weight.numba_ops import BLOCK, _delta_chunked, _delta_chunked_backward
from attnkit_kernelized.feature_maps import dpfp_feature_map, sum_normalized


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--chunk", type=int, default=32, help="chunk of the torch form")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    N, L, M, E = args.seqs, args.length, 128, 64
    rng = np.random.default_rng(0)
    q = rng.random((N, L, M), dtype=np.float32)
    q /= q.sum(-1, keepdims=True)
    k = rng.random((N, L, M), dtype=np.float32)
    k /= k.sum(-1, keepdims=True)
    v = rng.standard_normal((N, L, E), dtype=np.float32)
    beta = rng.random((N, L), dtype=np.float32)
    S0 = np.zeros((N, M, E), np.float32)
    dSL = rng.standard_normal((N, M, E), dtype=np.float32)
    out = np.empty((N, L, E), np.float32)
    ckpt = np.empty((N, -(-L // 64) + 1, M, E), np.float32)
    _delta_chunked(q, k, v, beta, 64, BLOCK, S0, out, ckpt, 0, N)
    dout = rng.standard_normal(out.shape, dtype=np.float32)
    grads = [np.empty_like(a) for a in (q, k, v, beta, dSL)]
    tq, tk, tv, tb = (torch.from_numpy(a)[None] for a in (q, k, v, beta))
    x, y, w = torch.randn(1, N, L, 64), torch.randn(1, N, L, 64), torch.randn(1, N, L, E)
    print(f"# attnkit_kernelized from {attnkit_kernelized.__file__}; {args.threads} thread(s), "
          f"{N} x {L} positions, M = {M}, E = {E}")
    with torch.no_grad():
        rows = {
            "numba-fwd": lambda: _delta_chunked(q, k, v, beta, 64, BLOCK, S0, out, ckpt, 0, N),
            "numba-bwd": lambda: _delta_chunked_backward(q, k, v, beta, ckpt, dout, dSL, 64, BLOCK, *grads, 0, N),
            "fused-fwd": lambda: fused_causal(x, y, w, tb, None, None),
            "torch-fwd": lambda: chunk.delta_rule(tq, tk, tv, tb, chunk=args.chunk),
            "dpfp": lambda: sum_normalized(dpfp_feature_map(x)),
        }
        for name, fn in rows.items():
            print(f"{name:10s} {median_ms(fn, args.repeats):8.1f} ms")


if __name__ == "__main__":
    main()
