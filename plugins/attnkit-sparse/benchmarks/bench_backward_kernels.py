"""The numba engine's backward, kernel by kernel: time of each step of ``numba_ops._backward`` at issue 10's
causal 256-key window (float32, B=1, H=8, D=64), interleaved, with optional A/B against another kernels module.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/bench_backward_kernels.py \\
        --L 16384 --rounds 7 [--old /tmp/old_kernels.py]

``--old``: a copy of an earlier ``_numba_kernels.py`` (e.g. ``git show <commit>:<path> > /tmp/old_kernels.py``);
its kernels run in the same rounds, alternating with the current ones. ``uptime`` is printed before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from attnkit import masks  # noqa: E402
from attnkit.numba_pool import run_parallel, run_ranges  # noqa: E402
from attnkit_sparse.engine import _numba_kernels as NEW  # noqa: E402
from attnkit_sparse.engine import numba_ops, plan  # noqa: E402


def load(path: str):
    name = "bench_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod   # numba's cache finds the module of a cached function by name
    spec.loader.exec_module(mod)
    return mod


def steps(K, a: dict) -> dict:
    """name -> thunk for each backward kernel of module ``K`` (the arrays in ``a``)."""
    bq, bk = a["bq"], a["bk"]
    stats = (a["lse"], a["delta"], a["H"])
    # session 42: the kernels read the element masks key-major, (P, BK, BQ)
    bank = a["bankT"] if "bankT" in inspect.signature(K._apply_tile_mask.py_func).parameters else a["bank"]
    # each module's own constants; the dtype flag only for kernels that still take it (before session 60)
    cst = (K.constants(np.float32, a["scale"]),
           *((True,) if "is32" in inspect.signature(K.forward.py_func).parameters else ()))
    fwd = (a["q"], a["k"], a["v"], a["H"], a["kv_count"], a["kv_idx"], a["kv_tile"], bank, a["span"], bq, bk, *cst)
    dkdv = (a["q"], a["k"], a["v"], a["g"], *stats, a["q_count"], a["q_idx"], a["q_tile"], a["q_slot"], bank, bq,
            bk, *cst, a["ds"], a["ds_off"], a["qT"], a["gT"])
    if "i1" in inspect.signature(K.forward.py_func).parameters:  # session 40: serial kernels over ranges of items
        def dkdv_ranges():
            dk, dv = np.zeros_like(a["k"]), np.zeros_like(a["v"])
            run_ranges(K.backward_dkdv, a["N"] * a["nk"], *dkdv, dk, dv, 0, a["nq"])

        return {
            "forward": lambda: run_ranges(K.forward, a["N"] * a["nq"], *fwd, np.empty_like(a["v"]),
                                          np.empty_like(a["lse"])),
            "dkdv+ds": dkdv_ranges,
            "dq_from_ds": lambda: run_ranges(K.backward_dq_from_ds, a["N"] * a["nq"], a["k"], a["ds"], a["ds_off"],
                                             np.empty_like(a["q"]), 0, a["nq"], a["H"], a["kv_count"], a["kv_idx"],
                                             bq, bk),
        }   # the per-sequence backward: "op auto" below
    out = {"forward": lambda: run_parallel(K.forward, *fwd, items=a["N"] * a["nq"])}
    if "qlo" in inspect.signature(K.backward_dkdv.py_func).parameters:  # session 38: ranges of query blocks
        def dkdv_ds():
            dk, dv = np.zeros_like(a["k"]), np.zeros_like(a["v"])
            run_parallel(K.backward_dkdv, *dkdv, dk, dv, 0, a["nq"], items=a["N"] * a["nk"])

        out["dkdv+ds"] = dkdv_ds
        out["dq_from_ds"] = lambda: run_parallel(K.backward_dq_from_ds, a["k"], a["ds"], a["ds_off"],
                                                 np.empty_like(a["q"]), 0, a["nq"], a["H"], a["kv_count"],
                                                 a["kv_idx"], bq, bk, items=a["N"] * a["nq"])
    else:  # before: the whole range, and dQ recomputed when the buffer did not fit
        out["dkdv+ds"] = lambda: run_parallel(K.backward_dkdv, *dkdv, items=a["N"] * a["nk"])
        out["dq_from_ds"] = lambda: run_parallel(K.backward_dq_from_ds, a["k"], a["ds"], a["ds_off"], a["L"], a["H"],
                                                 a["kv_count"], a["kv_idx"], bq, bk, items=a["N"] * a["nq"])
        out["dq_recompute"] = lambda: run_parallel(K.backward_dq, a["q"], a["k"], a["v"], a["g"], *stats,
                                                   a["kv_count"], a["kv_idx"], a["kv_tile"], bank, bq, bk,
                                                   *cst, items=a["N"] * a["nq"])
    if hasattr(K, "backward_heads"):
        span = (a["span"],) if "span" in inspect.signature(K.backward_heads.py_func).parameters else ()
        out["fused heads"] = lambda: run_parallel(K.backward_heads, a["q"], a["k"], a["v"], a["g"], *stats,
                                                  a["q_count"], a["q_idx"], a["q_tile"], bank, *span, bq, bk,
                                                  *cst, a["qT"], a["gT"], items=a["N"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=16384)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--old", default=None)
    ap.add_argument("--only", default=None, help="comma-separated step names")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    B, H, L, D = 1, args.H, args.L, 64
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(B, H, L, D) for _ in range(4))
    m = masks.causal() & masks.sliding_window(255)
    p = plan(m, B, H, L, L, block_size=64)
    bq, bk = p.block_size
    out, lse = numba_ops.numba_block_attention(q, k, v, p.kv_count, p.kv_idx, p.kv_tile, p.q_count, p.q_idx,
                                               p.q_tile, p.q_slot, p.key_major_bank(), p.span, bq, bk, D ** -0.5)
    delta = (g * out).sum(-1)
    arr = numba_ops._arr
    counts = p.kv_count.to(torch.int64)
    tiles = int(counts.sum(-1).max())
    qa = numba_ops._seq(q)
    ga = numba_ops._seq(g)
    a = dict(q=qa, k=numba_ops._seq(k), v=numba_ops._seq(v), g=ga, lse=arr(lse.reshape(B * H, L)),
             delta=arr(delta.reshape(B * H, L)), H=H, L=L, N=B * H, nq=p.kv_count.shape[-1],
             nk=p.q_count.shape[-1], bq=bq, bk=bk, scale=D ** -0.5,
             kv_count=arr(p.kv_count), kv_idx=arr(p.kv_idx), kv_tile=arr(p.kv_tile), q_count=arr(p.q_count),
             q_idx=arr(p.q_idx), q_tile=arr(p.q_tile), q_slot=arr(p.q_slot), bank=arr(p.bank), span=arr(p.span),
             bankT=arr(p.key_major_bank()),
             ds=np.empty((B * H, tiles, bk, bq), np.float32), ds_off=arr((counts.cumsum(-1) - counts).contiguous()),
             qT=np.ascontiguousarray(qa.transpose(0, 2, 1)), gT=np.ascontiguousarray(ga.transpose(0, 2, 1)))
    fns = {f"new {n}": f for n, f in steps(NEW, a).items()}
    if args.old:
        fns.update({f"old {n}": f for n, f in steps(load(args.old), a).items()})
    if args.only:
        keep = set(args.only.split(","))
        fns = {n: f for n, f in fns.items() if n.split(" ", 1)[1] in keep}
    def op():  # the whole backward op as the autograd runs it (allocations, transposes, Δ included)
        return numba_ops._backward(q, k, v, out, lse, g, torch.zeros_like(lse), p.kv_count, p.kv_idx, p.kv_tile,
                                   p.q_count, p.q_idx, p.q_tile, p.q_slot, p.bank, bq, bk, D ** -0.5)

    def op_unfused():
        numba_ops.FUSED_BACKWARD = False
        try:
            return op()
        finally:
            numba_ops.FUSED_BACKWARD = "auto"

    fns["op auto"] = op
    fns["op unfused"] = op_unfused
    for f in fns.values():
        f()
    ts = {n: [] for n in fns}
    items = list(fns.items())
    for r in range(args.rounds):
        for n, f in (items if r % 2 == 0 else items[::-1]):
            t0 = time.perf_counter()
            f()
            ts[n].append(time.perf_counter() - t0)
    for n, t in ts.items():
        print(f"{n:24s} median {statistics.median(t) * 1e3:8.1f} ms  min {min(t) * 1e3:8.1f} ms", flush=True)
    print("uptime after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
