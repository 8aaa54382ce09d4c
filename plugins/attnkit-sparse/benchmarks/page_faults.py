"""How much of a training step is first touches of fresh memory: minor page faults and system time per step.

For each ``--mechanisms`` (sparse plugin, float32, B = 1, H = 8, D = 64, bidirectional, two threads by default):
a module in training mode, inputs and the output gradient made once and reused (so what is counted is the
mechanism's own memory plus the three input gradients, ``3·B·H·L·D`` floats), two warm-up steps, then
``--steps`` steps; reported: the median step, minor page faults per step (and the MiB of 4 KiB pages that is),
system and user CPU seconds per step (``resource.getrusage``).

With ``--keep-freed-memory`` the run first calls :func:`attnkit.cpu_memory.keep_freed_memory` (process-wide, so
compare it with a run without, alternated). With ``--numpy-alloc``, the steps alternate between torch's
allocation and NumPy's for every ``Tensor.new_empty`` (NumPy asks for transparent huge pages on 4 MiB and more),
the order flipped each round.

    python plugins/attnkit-sparse/benchmarks/page_faults.py --length 16384 --mechanisms sinkhorn lsh local routing
    python plugins/attnkit-sparse/benchmarks/page_faults.py --length 16384 --mechanisms sinkhorn --numpy-alloc
    python plugins/attnkit-sparse/benchmarks/page_faults.py --length 16384 --keep-freed-memory

Nothing here is a test: figures for docs/benchmarks.md ("Session 43").
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np
import torch

import attnkit

B, H, D = 1, 8, 64


def options(mech: str, L: int) -> dict:
    return {"sinkhorn": {"block_size": 64, "num_heads": H, "head_dim": D, "sinkhorn_iters": 8, "temperature": 0.75},
            "routing": {"num_clusters": max(1, L // 128), "num_heads": H, "head_dim": D},
            "lsh": {"bucket_size": 64, "n_hashes": 4, "seed": 0},
            "local": {"window": 256},
            "bigbird": {}}[mech]


def _numpy_new_empty(self: torch.Tensor, *shape, **kw) -> torch.Tensor:  # noqa: ANN002, ANN003
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    dtype = kw.get("dtype") or self.dtype
    return torch.from_numpy(np.empty(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--mechanisms", nargs="+", default=["sinkhorn", "lsh", "local", "routing"])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--numpy-alloc", action="store_true", help="alternate torch's and NumPy's new_empty")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="call attnkit.cpu_memory.keep_freed_memory() first (process-wide: compare separate runs)")
    args = p.parse_args()
    if args.keep_freed_memory:
        from attnkit.cpu_memory import keep_freed_memory
        print(f"# keep_freed_memory(): {keep_freed_memory()}")
    torch.set_num_threads(args.threads)
    L = args.length
    torch_new_empty = torch.Tensor.new_empty
    print(f"# L = {L}, B = {B}, H = {H}, D = {D}, float32, {args.threads} thread(s), {args.steps} steps")
    for mech in args.mechanisms:
        m = attnkit.build(mech, **options(mech, L))
        m.train()
        q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
        if mech == "lsh":
            k = q
        g = torch.ones(B, H, L, D)

        def step(m: torch.nn.Module = m, q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                 g: torch.Tensor = g) -> float:
            for x in (q, k, v):
                x.grad = None
            t0 = time.perf_counter()
            m(q, k, v).backward(g)
            attnkit.clear_aux_losses(m)
            return time.perf_counter() - t0

        sides = ("torch", "numpy") if args.numpy_alloc else ("torch",)
        ts: dict[str, list[float]] = {s: [] for s in sides}
        use = {s: [0, 0.0, 0.0] for s in sides}
        for r in range(args.steps + 2):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                torch.Tensor.new_empty = _numpy_new_empty if side == "numpy" else torch_new_empty
                try:
                    u0 = resource.getrusage(resource.RUSAGE_SELF)
                    t = step()
                    u1 = resource.getrusage(resource.RUSAGE_SELF)
                finally:
                    torch.Tensor.new_empty = torch_new_empty
                if r >= 2:
                    ts[side].append(t)
                    use[side][0] += u1.ru_minflt - u0.ru_minflt
                    use[side][1] += u1.ru_stime - u0.ru_stime
                    use[side][2] += u1.ru_utime - u0.ru_utime
        for side in sides:
            n = args.steps
            flt, sys_s, usr_s = use[side][0] / n, use[side][1] / n, use[side][2] / n
            print(f"{mech:9s} {side:5s} step median {statistics.median(ts[side]) * 1e3:7.1f} ms; minor faults/step "
                  f"{flt:8.0f} ({flt * 4 / 1024:5.0f} MiB of 4 KiB pages); system {sys_s:.3f} s, user {usr_s:.3f} s "
                  f"per step", flush=True)


if __name__ == "__main__":
    main()
