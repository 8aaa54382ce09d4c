"""``routing``'s CPU training step with NumPy's transparent-huge-page requests on and off, between dense steps.

NumPy asks the kernel for transparent huge pages (``madvise``) on every array of 4 MiB or more; the fused numba
paths allocate their outputs with NumPy. This runs, in one process and round by round, a dense SDPA training step
at the same length (it allocates and frees gigabytes, as ``bench_lucidrains.py``'s order does), ``routing``'s
training step with NumPy's requests on, the same with them off (``numpy._core.multiarray._set_madvise_hugepage``),
and routing-transformer's step; medians of the step times and each round's page faults. Run it in the benchmark
venv of ``bench_lucidrains.py``; ``kept`` as the first argument calls :func:`attnkit.cpu_memory.keep_freed_memory`
first::

    python plugins/attnkit-sparse/benchmarks/bench_routing_thp.py [kept]

Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from numpy._core.multiarray import _set_madvise_hugepage

import attnkit

B, H, L, D = 1, 8, 16384, 64


class _SDPA(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


def main() -> None:
    from attnkit.cpu_memory import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1:] == ["kept"] else None
    torch.set_num_threads(2)
    from routing_transformer.routing_transformer import KmeansAttention
    ours = attnkit.build("routing", num_clusters=L // 128, num_heads=H, head_dim=D)
    ref = KmeansAttention(num_clusters=L // 128, window_size=128, num_heads=H, head_dim=D, causal=False)

    def step(m: torch.nn.Module) -> tuple[float, int]:
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3))
        m.train(True)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        out = m(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        if m is ours:
            attnkit.clear_aux_losses(m)
        return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    def ours_with(thp: bool) -> tuple[float, int]:
        _set_madvise_hugepage(thp)
        try:
            return step(ours)
        finally:
            _set_madvise_hugepage(True)

    rows: dict[str, list[tuple[float, int]]] = {"sdpa": [], "routing, NumPy THP": [], "routing, no THP": [],
                                                 "routing-transformer": []}
    step(ours), step(ref)
    for _ in range(4):
        rows["sdpa"].append(step(_SDPA()))
        rows["routing, NumPy THP"].append(ours_with(True))
        rows["routing, no THP"].append(ours_with(False))
        rows["routing-transformer"].append(step(ref))
    print(f"# L = {L}, H = {H}, D = {D}, float32, 2 threads, keep_freed_memory: {kept}")
    for name, xs in rows.items():
        print(f"{name:22s} {statistics.median(t for t, _ in xs) * 1e3:8.1f} ms  faults {[f for _, f in xs]}")


if __name__ == "__main__":
    main()
