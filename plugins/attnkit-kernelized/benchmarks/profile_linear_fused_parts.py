"""Where ``linear``'s fused causal forward (linear/numba_fused.py) spends its time: the same block loop compiled
with parts switched off, every variant timed in the same rounds (alternated), median wall time.

Variants (each a copy of the kernel's loop over blocks of ``--chunk`` positions, float32):

* ``full``: features, the state's product (``inter``), the causal triangle (``tri``), the state update
  (``state``) and the rest (``misc``: the keys transposed, the block buffer zeroed and copied out, the
  denominators, ``z``);
* ``full, features by loops``: as ``full`` with the features by the two-pass numba loops
  (``_vexp._exp_loops``, the form before session 37) instead of :func:`~attnkit_kernelized._vexp.elu1_row`;
* ``full, hot``: every block reads and writes the first block's rows (inputs and output stay in cache): the
  difference to ``full`` is the cost of memory;
* ``full, no output``: the block's output is not copied out;
* ``features``, ``features by loops``, ``inter``, ``tri``, ``state``, ``misc``: one part alone.

    python plugins/attnkit-kernelized/benchmarks/profile_linear_fused_parts.py [--threads 2] [--length 8192]

Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
import torch

from attnkit.numba_panel import axpy_rows
from attnkit_kernelized._tiles import divide_row
from attnkit_kernelized._vexp import HALF, _exp_loops, constants, elu1_row

_FM = {"reassoc", "contract", "nsz"}


@numba.njit(cache=True, fastmath=_FM, inline="always")
def _elu_loops(dst, src, n, e, nbuf, one, zero, cst):  # pragma: no cover - compiled
    """``elu(x) + 1`` as the fused kernel computed it before session 37: two passes around a two-pass exp."""
    for j in range(n):
        v = src[j]
        dst[j] = v
        e[j] = zero if v > zero else v
    _exp_loops(e[:n], zero, nbuf, cst, True)
    for j in range(n):
        v = dst[j]
        dst[j] = v + one if v > zero else e[j]


def _make(feat: int, inter: bool, tri: bool, state: bool, misc: bool, hot: bool = False, copy_out: bool = True):
    @numba.njit(fastmath=_FM, parallel=True)
    def kern(Q, K, V, cst, chunk, out):  # pragma: no cover - compiled
        N, L, M = Q.shape
        E = V.shape[2]
        zero = cst[HALF] - cst[HALF]
        one = cst[HALF] + cst[HALF]
        Qf = Q.reshape((N, L * M))
        Kf = K.reshape((N, L * M))
        for n in numba.prange(N):
            xf = np.zeros(chunk * M, Q.dtype)
            yf = np.zeros(chunk * M, Q.dtype)
            xb = xf.reshape((chunk, M))
            yb = yf.reshape((chunk, M))
            yT = np.zeros((M, chunk), Q.dtype)
            A = np.zeros((chunk, chunk), Q.dtype)
            oc = np.zeros((chunk, E), Q.dtype)
            eb = np.empty(chunk * M, Q.dtype)
            nbuf = np.empty(chunk * M, np.int32)
            vn = V[n]
            outn = out[n]
            S = np.zeros((M, E), Q.dtype)
            z = np.zeros(M, Q.dtype)
            for b0 in range(0, L, chunk):
                c0 = 0 if hot else b0
                c1 = min(c0 + chunk, L)
                T = c1 - c0
                if feat == 1:
                    elu1_row(xf, Qf[n, c0 * M:c1 * M], one, nbuf, cst, True)
                    elu1_row(yf, Kf[n, c0 * M:c1 * M], one, nbuf, cst, True)
                elif feat == 2:
                    _elu_loops(xf, Qf[n, c0 * M:c1 * M], T * M, eb, nbuf, one, zero, cst)
                    _elu_loops(yf, Kf[n, c0 * M:c1 * M], T * M, eb, nbuf, one, zero, cst)
                wc = vn[c0:c1]
                if misc:
                    for j in range(M):
                        d_ = yT[j]
                        for t in range(T):
                            d_[t] = yb[t, j]
                    for t in range(T):
                        o_ = oc[t]
                        for e in range(E):
                            o_[e] = zero
                if inter:
                    axpy_rows(oc, xb, S, T, M, E)
                if tri:
                    for i in range(0, T, 4):
                        r = min(4, T - i)
                        n16 = min(T, (i + r + 15) // 16 * 16)
                        for t in range(r):
                            a_ = A[i + t]
                            for j in range(n16):
                                a_[j] = zero
                        axpy_rows(A[i:], xb[i:], yT, r, M, n16)
                        for t in range(r):
                            a_ = A[i + t]
                            for j in range(i + t + 1, i + r):
                                a_[j] = zero
                        axpy_rows(oc[i:], A[i:], wc, r, i + r, E)
                        if misc:
                            for t in range(r):
                                a_ = A[i + t]
                                s = zero
                                for j in range(i + t + 1):
                                    s += a_[j]
                                xa = xb[i + t]
                                for m in range(M):
                                    s += xa[m] * z[m]
                                divide_row(oc[i + t], s, E, zero)
                if state:
                    axpy_rows(S, yT, wc, M, T, E)
                if misc:
                    for m in range(M):
                        yr = yT[m]
                        s = zero
                        for t in range(T):
                            s += yr[t]
                        z[m] += s
                    if copy_out:
                        for t in range(T):
                            o_ = oc[t]
                            d_ = outn[c0 + t]
                            for e in range(E):
                                d_[e] = o_[e]

    return kern


VARIANTS = {
    "full": (1, True, True, True, True),
    "full, features by loops": (2, True, True, True, True),
    "full, hot": (1, True, True, True, True, True),
    "full, no output": (1, True, True, True, True, False, False),
    "features": (1, False, False, False, False),
    "features by loops": (2, False, False, False, False),
    "inter": (0, True, False, False, False),
    "tri": (0, False, True, False, False),
    "state": (0, False, False, True, False),
    "misc": (0, False, False, False, True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    N, L, D = args.heads, args.length, 64
    g = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(N, L, D, generator=g).numpy() for _ in range(3))
    cst = constants(np.float32)
    kernels = {name: _make(*flags) for name, flags in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for f in kernels.values():
        f(Q, K, V, cst, args.chunk, torch.empty(N, L, D).numpy())
    for r in range(args.rounds):
        names = list(kernels) if r % 2 == 0 else list(kernels)[::-1]
        for name in names:
            out = np.empty((N, L, D), dtype=np.float32)   # as the kernel's own output (NumPy: huge pages)
            t0 = time.perf_counter()
            kernels[name](Q, K, V, cst, args.chunk, out)
            times[name].append(time.perf_counter() - t0)
    print(f"# linear fused forward, parts: L = {L}, H = {N}, D = E = 64, block {args.chunk}, float32, "
          f"{args.threads} thread(s), {args.rounds} rounds, median wall time")
    for name, ts in times.items():
        print(f"{name:26s} {statistics.median(ts) * 1e3:7.2f} ms  (min {min(ts) * 1e3:.2f})")


if __name__ == "__main__":
    main()
