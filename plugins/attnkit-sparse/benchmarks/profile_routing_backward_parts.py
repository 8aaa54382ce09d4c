"""Where ``routing``'s fused backward (routing/_fused.py ``backward_seq``) spends its time: a copy of its loop
with parts switched off, and with the routed rows prefetched, every variant in the same rounds.

Random balanced clusters (each cluster 128 query and 128 key positions drawn from a permutation, ascending),
L = 16,384, H = 8, D = E = 64, float32, 2 threads, sequences handed to threads as the module does. Variants:
``real`` (the plugin's kernel as it is), ``full`` (the copy, no prefetch), ``full+pf8`` (the gathered rows
prefetched 8 ahead), ``full+pf8+scat`` (and the rows the gradients are added to: what the plugin does since
session 37), ``full, hot rows`` (every position below 256: all rows in cache), and parts switched off.

    python plugins/attnkit-sparse/benchmarks/profile_routing_backward_parts.py

Nothing here is a test: figures for docs/benchmarks.md.
"""
# ruff: noqa: E701, E702, E501, B023
import statistics
import time

import numba
import numpy as np
import torch

from attnkit.numba_panel import axpy_at, axpy_t
from attnkit.numba_pool import kernel_threads, run_items, start_pool
from attnkit.numba_prefetch import prefetch_row
from attnkit_sparse._gathered import gather_kv, gather_query_grad, transpose_columns, zero_kv
from attnkit_sparse.engine._numba_kernels import _HALF, _SC, FASTMATH, _exp_sub, constants
from attnkit_sparse.routing._fused import backward_seq


def make(EXP, PROD, GATH, SCAT, INIT, PF=0, PD=8):
    @numba.njit(fastmath=FASTMATH, nogil=True)
    def bseq(q, k, v, g, out, qi, ki, nq, nk, lse, cst, n, dq, dk, dv):
        N, L, D = q.shape; E = v.shape[2]; C, W = qi.shape[1], qi.shape[2]
        BQ = min(W, 64); dt = q.dtype
        zero = cst[_HALF] - cst[_HALF]; one = cst[cst.shape[0] - 1]; sc = cst[_SC]
        QT = np.zeros((D, BQ), dtype=dt); Qb = np.zeros((BQ, D), dtype=dt)
        GT = np.zeros((E, BQ), dtype=dt); Gb = np.zeros((BQ, E), dtype=dt)
        Kb = np.zeros((W, D), dtype=dt); Vb = np.zeros((W, E), dtype=dt)
        ST = np.zeros((W, BQ), dtype=dt); DT = np.zeros((W, BQ), dtype=dt)
        dQb = np.zeros((BQ, D), dtype=dt); dKb = np.zeros((W, D), dtype=dt); dVb = np.zeros((W, E), dtype=dt)
        lrow = np.zeros(BQ, dtype=dt); drow = np.zeros(BQ, dtype=dt)
        qs = q[n]; ks = k[n]; vs = v[n]; gs = g[n]; os_ = out[n]
        dqn = dq[n]; dkn = dk[n]; dvn = dv[n]
        dl = np.zeros(L, dtype=dt)
        if INIT:
            for p in range(L):
                a = dqn[p]; b = dkn[p]
                for d in range(D):
                    a[d] = zero; b[d] = zero
                c_ = dvn[p]; gp = gs[p]; op = os_[p]
                acc = zero
                for e in range(E):
                    c_[e] = zero; acc += gp[e] * op[e]
                dl[p] = acc
        for c in range(C):
            qn = nq[n, c]; kn = nk[n, c]
            pq = qi[n, c]; pk = ki[n, c]
            if PF == 1 and c + 1 < C:
                nq1 = qi[n, c + 1]; nk1 = ki[n, c + 1]
                for j in range(nk[n, c + 1]):
                    prefetch_row(ks, nk1[j]); prefetch_row(vs, nk1[j])
                for i in range(nq[n, c + 1]):
                    prefetch_row(qs, nq1[i]); prefetch_row(gs, nq1[i])
            if GATH:
                for j in range(kn):
                    if PF >= 2 and j + PD < kn:
                        prefetch_row(ks, pk[j + PD]); prefetch_row(vs, pk[j + PD])
                    gather_kv(Kb, Vb, j, ks[pk[j]], vs[pk[j]])
                    zero_kv(dKb, dVb, j, zero)
            for q0 in range(0, qn, BQ):
                bn = min(BQ, qn - q0)
                pb = pq[q0:q0 + bn]
                if GATH:
                    for i in range(bn):
                        p = pb[i]
                        if PF >= 2 and i + PD < bn:
                            prefetch_row(qs, pb[i + PD]); prefetch_row(gs, pb[i + PD])
                        gather_query_grad(Qb, Gb, i, qs[p], gs[p], sc)
                        lrow[i] = lse[n, p]; drow[i] = dl[p]
                    transpose_columns(QT, Qb, bn, zero); transpose_columns(GT, Gb, bn, zero)
                if PROD:
                    for j in range(kn):
                        row = ST[j]
                        for i in range(BQ):
                            row[i] = zero
                    axpy_at(ST, kn, Kb, 0, QT, 0, D)
                    for j in range(kn):
                        drw = DT[j]
                        for i in range(BQ):
                            drw[i] = zero
                    axpy_at(DT, kn, Vb, 0, GT, 0, E)
                for j in range(kn):
                    row = ST[j]; drw = DT[j]
                    if EXP:
                        _exp_sub(row, one, lrow)
                    if EXP or PROD:
                        for i in range(BQ):
                            drw[i] = row[i] * (drw[i] - drow[i])
                if PROD:
                    axpy_at(dVb, kn, ST, 0, Gb, 0, bn)
                    axpy_at(dKb, kn, DT, 0, Qb, 0, bn)
                    for i in range(bn):
                        qd = dQb[i]
                        for d in range(D):
                            qd[d] = zero
                    axpy_t(dQb, 0, bn, DT, Kb, 0, 0, kn)
                if SCAT:
                    for i in range(bn):
                        if PF == 3 and i + PD < bn:
                            prefetch_row(dqn, pb[i + PD])
                        dst = dqn[pb[i]]; src = dQb[i]
                        for d in range(D):
                            dst[d] += src[d] * sc
            if SCAT:
                for j in range(kn):
                    p = pk[j]
                    if PF == 3 and j + PD < kn:
                        prefetch_row(dkn, pk[j + PD]); prefetch_row(dvn, pk[j + PD])
                    dst = dkn[p]; src = dKb[j]
                    for d in range(D):
                        dst[d] += src[d]
                    dstv = dvn[p]; srcv = dVb[j]
                    for e in range(E):
                        dstv[e] += srcv[e]
    return bseq

torch.set_num_threads(2)
N, L, D, W = 8, 16384, 64, 128
C = L // W
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((N, L, D)).astype(np.float32) for _ in range(4))
out = rng.standard_normal((N, L, D)).astype(np.float32) * 0.1
lse = (rng.standard_normal((N, L)) + 5).astype(np.float32)
qi = np.stack([np.sort(rng.permutation(L).reshape(C, W), axis=1) for _ in range(N)]).astype(np.int64)
ki = np.stack([np.sort(rng.permutation(L).reshape(C, W), axis=1) for _ in range(N)]).astype(np.int64)
nq = np.full((N, C), W, np.int64); nk = np.full((N, C), W, np.int64)
cst = constants(np.float32, 0.125)
start_pool()
variants = {"real": None, "full": (1,1,1,1,1), "full+pf8": (1,1,1,1,1,2), "full+pf8+scat": (1,1,1,1,1,3,8), "full, hot rows": (1,1,1,1,1), "no exp": (0,1,1,1,1), "no products": (1,0,1,1,1), "no gather": (1,1,0,1,1),
            "no scatter": (1,1,1,0,1), "no init": (1,1,1,1,0), "exp only": (1,0,0,0,0), "products only": (0,1,0,0,0), "none": (0,0,0,0,0)}
ks_ = {name: (backward_seq if fl is None else make(*fl)) for name, fl in variants.items()}
qi_hot = (qi % 256); ki_hot = (ki % 256)
def call(name):
    f = ks_[name]
    if name == "full, hot rows":
        dq, dk, dv = (np.empty((N, L, D), np.float32) for _ in range(3))
        run_items(lambda n: f(q, k, v, g, out, qi_hot, ki_hot, nq, nk, lse, cst, n, dq, dk, dv), N, threads=kernel_threads())
        return
    dq, dk, dv = (np.empty((N, L, D), np.float32) for _ in range(3))
    if name == "real":
        run_items(lambda n: f(q, k, v, g, out, qi, ki, nq, nk, lse, False, cst, n, dq, dk, dv), N, threads=kernel_threads())
    else:
        run_items(lambda n: f(q, k, v, g, out, qi, ki, nq, nk, lse, cst, n, dq, dk, dv), N, threads=kernel_threads())
for name in ks_: call(name)
ts = {name: [] for name in ks_}
for r in range(7):
    for name in (list(ks_) if r % 2 == 0 else list(ks_)[::-1]):
        t = time.perf_counter(); call(name); ts[name].append(time.perf_counter() - t)
for name in ks_:
    print(f"{name:15s} {statistics.median(ts[name])*1e3:7.1f} ms")
A = torch.randn(2048, 128, 64); B_ = torch.randn(2048, 64, 64)
def tb():
    for _ in range(5): torch.bmm(A, B_)
tb(); tt=[]
for _ in range(5):
    t=time.perf_counter(); tb(); tt.append(time.perf_counter()-t)
a=torch.randn(1024,1024); b=torch.randn(1024,1024); a@b; mt=[]
for _ in range(10):
    t=time.perf_counter(); a@b; mt.append(time.perf_counter()-t)
print(f"torch bmm of the same 5 products: {statistics.median(tt)*1e3:.1f} ms; matmul rate {2*1024**3/statistics.median(mt)/1e9:.0f} GFLOP/s")
