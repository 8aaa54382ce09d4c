"""``routing``'s resident memory on CPU (numba): the process's peak and its resident size around an eval forward.

One process per length (run the script once per ``--length``): float32, B = 1, H = 8, D = 64,
``num_clusters = L / 128``. A first eval forward loads the kernels; the figures are ``ru_maxrss`` (the peak)
and the resident size after the first and after a second forward (``/proc/self/statm``)::

    python plugins/attnkit-sparse/benchmarks/mem_routing.py --length 16384
    python plugins/attnkit-sparse/benchmarks/mem_routing.py --length 65536

Run it once before quoting a figure: in an empty numba cache the first run compiles the kernels, and LLVM's memory
then sets the peak. Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import resource

import torch

import attnkit


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    B, H, L, D = 1, 8, a.length, 64
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    m = attnkit.build("routing", num_clusters=max(1, L // 128), num_heads=H, head_dim=D, backend="numba").eval()
    with torch.no_grad():
        m(q, k, v)
    first = _resident_mib()
    with torch.no_grad():
        m(q, k, v)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"L = {L}: peak RSS {peak:.0f} MiB; resident after the first forward {first:.0f} MiB, "
          f"after a second {_resident_mib():.0f} MiB")


if __name__ == "__main__":
    main()
