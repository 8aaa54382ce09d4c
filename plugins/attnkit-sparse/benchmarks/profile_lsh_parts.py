"""Where ``lsh``'s CPU forward spends its time: each part timed on its own, alternated, with SDPA beside.

Parts: the whole forward, hashing (``buckets``), the counting sort, the unit keys, the fused attention
(:func:`attnkit_sparse.lsh.fused.attend_rounds`) and SDPA; float32, B = 1, H = 8, D = 64, 4 rounds, bucket 64,
2 threads, shared-QK. Medians (and minima) of 5 rounds of calls::

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/profile_lsh_parts.py [L]
"""

from __future__ import annotations

import sys
import time

import torch

import attnkit
from attnkit_sparse.lsh.fused import attend_rounds
from attnkit_sparse.lsh.hashing import buckets, real_lengths, sort_rounds, unit


def main() -> None:
    torch.set_num_threads(2)
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    reps, B, H, D = 5, 1, 8, 64
    torch.manual_seed(0)
    q, v = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    m = attnkit.build("lsh", bucket_size=64, n_hashes=4, backend="numba")
    print(f"# load {open('/proc/loadavg').read().split()[:3]}, L = {L}", flush=True)
    with torch.no_grad():
        rot = m.rotations(L, D, dtype=q.dtype, device=q.device)
        lengths = real_lengths(B, L, None, q.device)
        bk = buckets(q, rot, 64, lengths)
        perm = sort_rounds(bk, None)
        kh = unit(q)
        parts = {
            "forward": lambda: m(q, q, v),
            "hash": lambda: buckets(q, rot, 64, lengths),
            "sort": lambda: sort_rounds(bk, None),
            "unit": lambda: unit(q),
            "attention": lambda: attend_rounds(q, kh, v, perm, None, causal=False, chunk=64, scale=D ** -0.5),
            "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, q, v),
        }
        ts: dict[str, list[float]] = {k: [] for k in parts}
        for f in parts.values():
            f()
        for _ in range(reps):
            for k, f in parts.items():
                t0 = time.perf_counter()
                f()
                ts[k].append(time.perf_counter() - t0)
    for k, x in ts.items():
        print(f"{k:10s} {sorted(x)[reps // 2] * 1e3:8.1f} ms  (min {min(x) * 1e3:.1f})")
    print(f"# load at the end {open('/proc/loadavg').read().split()[:3]}", flush=True)


if __name__ == "__main__":
    main()
