"""lsh, routing and sinkhorn forward+backward with the engine's one-kernel-per-sequence backward
(``numba_ops.FUSED_BACKWARD = True``) against the two-kernel path (``False``), alternating in one process.

float32, B=1, H=8, D=64, 2 threads; lsh 4 rounds bucket 64 shared-QK, routing L/256 clusters, sinkhorn block 64
(bench_content's cases). Medians of ``ROUNDS`` rounds; ``uptime`` before and after.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-sparse/benchmarks/bench_fused_backward_content.py 16384 3
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import attnkit  # noqa: E402
from attnkit_sparse.engine import numba_ops  # noqa: E402


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    L, rounds = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    B, H, D = 1, 8, 64
    print("uptime before:", uptime(), flush=True)
    lsh = attnkit.build("lsh", bucket_size=64, n_hashes=4, backend="numba")
    routing = attnkit.build("routing", num_clusters=max(1, L // 256), num_heads=H, head_dim=D, backend="numba").eval()
    sinkhorn = attnkit.build("sinkhorn", block_size=64, num_heads=H, head_dim=D, backend="numba").eval()
    cases = {"lsh": lambda q, k, v: lsh(q, q, v), "routing": routing, "sinkhorn": sinkhorn}
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(B, H, L, D, generator=g).requires_grad_(True) for _ in range(3)]

    def once(fn, fused: bool) -> float:
        numba_ops.FUSED_BACKWARD = fused
        t0 = time.perf_counter()
        fn(*x).sum().backward()
        return time.perf_counter() - t0

    for name, fn in cases.items():
        once(fn, True)
        once(fn, False)
        ts: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for f in ((True, False) if r % 2 == 0 else (False, True)):
                ts[f].append(once(fn, f))
        print(f"{name:9s} fwd+bwd fused {statistics.median(ts[True]) * 1e3:7.1f} ms  "
              f"two kernels {statistics.median(ts[False]) * 1e3:7.1f} ms", flush=True)
    numba_ops.FUSED_BACKWARD = "auto"
    print("uptime after:", uptime(), flush=True)


if __name__ == "__main__":
    main()
