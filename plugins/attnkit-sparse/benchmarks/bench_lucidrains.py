"""attnkit's content-based attentions against lucidrains' packages, in one process, interleaved.

Never a dependency of attnkit: the public packages live in a separate benchmark venv that also has
attnkit's core and sparse plugin installed::

    python -m venv /work/venvs/bench-i11
    /work/venvs/bench-i11/bin/pip install -c constraints.txt -e packages/attnkit -e plugins/attnkit-sparse \\
        reformer-pytorch==1.4.4 routing-transformer==1.6.1 sinkhorn-transformer==0.11.4
    flock /tmp/attnkit-bench.lock /work/venvs/bench-i11/bin/python \\
        plugins/attnkit-sparse/benchmarks/bench_lucidrains.py --lengths 1024,4096,16384

float32, B = 1, H = 8, D = 64, bidirectional, the same settings on both sides:

* ``lsh``: 4 hash rounds, buckets of 64, shared-QK; reformer-pytorch ``LSHAttention(bucket_size=64,
  n_hashes=4)`` on the 8 sequences (it folds heads into the batch);
* ``routing``: ``num_clusters = L / 128`` (each cluster routes 128 queries and keys); routing-transformer
  ``KmeansAttention(num_clusters=L/128, window_size=128, num_heads=8, head_dim=64)``;
* ``sinkhorn``: blocks of 64, 8 Sinkhorn iterations, temperature 0.75; sinkhorn-transformer
  ``SinkhornAttention(bucket_size=64, dim=512, dim_heads=64, heads=8, max_seq_len=L, non_permutative=False,
  sinkhorn_iter=8, temperature=0.75)`` (Gumbel-Sinkhorn, as ours), and as ``sinkhorn-transformer-topk`` the
  package's default ``non_permutative=True`` (a top-1 bucket per query bucket, no Sinkhorn iterations: less
  work than the paper's method; the figure earlier sessions compared with). Note that 0.11.4 attends the
  sorted *keys* as values (``b_v_r = b_k_r.reshape(...)``), so neither is the same computation as ours;
* ``sdpa``: dense ``scaled_dot_product_attention`` for scale.

Forward runs in eval mode under ``no_grad``; forward+backward in train mode (both sides update their
k-means centroids there). Each case: one warm-up, then ``--repeats`` calls; the cases of one length
alternate call by call, so load drifts affect them alike. Medians (min-max) in seconds.

``--keep-freed-memory`` first calls :func:`attnkit.cpu_memory.keep_freed_memory` (glibc's allocator keeps freed
memory for the next step instead of returning it and faulting it in again; docs/user-guide.md). It is
process-wide, so it applies to both sides of every pair alike; compare it with a run without it, not within one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnkit

B, H, D = 1, 8, 64
PAIRS = (("lsh", "reformer-pytorch"), ("routing", "routing-transformer"), ("sinkhorn", "sinkhorn-transformer"),
         ("sinkhorn", "sinkhorn-transformer-topk"))


def _inputs(L: int, grad: bool, shared: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(L)
    q = torch.randn(B, H, L, D, generator=g)
    k = q.clone() if shared else torch.randn(B, H, L, D, generator=g)
    v = torch.randn(B, H, L, D, generator=g)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def cases(L: int) -> dict[str, tuple[Callable[..., torch.Tensor], torch.nn.Module | None, bool]]:
    """name -> (call(q, k, v), module or None, shared-QK inputs)."""
    from reformer_pytorch.reformer_pytorch import LSHAttention
    from routing_transformer.routing_transformer import KmeansAttention
    from sinkhorn_transformer.sinkhorn_transformer import SinkhornAttention

    clusters = max(1, L // 128)
    torch.manual_seed(0)
    ours_lsh = attnkit.build("lsh", bucket_size=64, n_hashes=4, seed=0)
    ref_lsh = LSHAttention(bucket_size=64, n_hashes=4, causal=False)
    ours_rt = attnkit.build("routing", num_clusters=clusters, num_heads=H, head_dim=D)
    ref_rt = KmeansAttention(num_clusters=clusters, window_size=128, num_heads=H, head_dim=D, causal=False)
    ours_sk = attnkit.build("sinkhorn", block_size=64, num_heads=H, head_dim=D)
    # the same algorithm as ours: Gumbel-Sinkhorn sorting, 8 iterations, temperature 0.75
    ref_sk = SinkhornAttention(bucket_size=64, dim=H * D, dim_heads=D, heads=H, max_seq_len=L, non_permutative=False,
                               sinkhorn_iter=8, temperature=0.75)
    # the package's default (non_permutative=True): top-1 bucket per query bucket, no Sinkhorn iterations
    ref_sk_top = SinkhornAttention(bucket_size=64, dim=H * D, dim_heads=D, heads=H, max_seq_len=L)

    def reformer(q, k, v):
        out = ref_lsh(q.reshape(B * H, L, D), v.reshape(B * H, L, D))[0]
        return out.reshape(B, H, L, D)

    def kmeans(q, k, v):
        out = ref_rt(q, k, v)
        return out[0] if isinstance(out, tuple) else out

    return {
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), None, False),
        "lsh": (lambda q, k, v: ours_lsh(q, q, v), ours_lsh, True),
        "reformer-pytorch": (reformer, ref_lsh, True),
        "routing": (lambda q, k, v: ours_rt(q, k, v), ours_rt, False),
        "routing-transformer": (kmeans, ref_rt, False),
        "sinkhorn": (lambda q, k, v: ours_sk(q, k, v), ours_sk, False),
        "sinkhorn-transformer": (lambda q, k, v: ref_sk(q, k, v), ref_sk, False),
        "sinkhorn-transformer-topk": (lambda q, k, v: ref_sk_top(q, k, v), ref_sk_top, False),
    }


def once(fn: Callable[..., torch.Tensor], module: torch.nn.Module | None, L: int, backward: bool,
         shared: bool) -> float:
    q, k, v = _inputs(L, backward, shared)
    if module is not None:
        module.train(backward)
    t = time.perf_counter()
    if backward:
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
        if module is not None and hasattr(module, "record_aux_loss"):
            # routing's commitment term: neither side backpropagates its auxiliary loss here, and an uncollected
            # one accumulates across calls (holding every step's graph), so it is dropped after each step
            attnkit.clear_aux_losses(module)
    else:
        with torch.no_grad():
            fn(q, k, v)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dense-max", type=int, default=16384, help="skip SDPA above this length")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--cases", default=None,
                    help="comma-separated subset of the pairs to run: lsh, routing, sinkhorn (default all; "
                         "sdpa always)")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="call attnkit.cpu_memory.keep_freed_memory() first (process-wide: both sides alike)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kept = None
    if args.keep_freed_memory:
        from attnkit.cpu_memory import keep_freed_memory
        kept = keep_freed_memory()
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    import attnkit_sparse
    src = os.path.dirname(attnkit_sparse.__file__)
    rev = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    print(f"# {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads; {up}")
    print(f"# attnkit_sparse from {src} (git {rev or 'n/a'})")
    if kept is not None:
        print(f"# keep_freed_memory(): {kept}")
    rows: list[dict[str, Any]] = []
    for L in [int(x) for x in args.lengths.split(",")]:
        table = cases(L)
        if L > args.dense_max:
            table.pop("sdpa")
        if args.cases:
            keep = {"sdpa"} | {n for pair in PAIRS if pair[0] in args.cases.split(",") for n in pair}
            table = {n: c for n, c in table.items() if n in keep}
        for mode, bw in (("forward", False), ("forward_backward", True)):
            times: dict[str, list[float]] = {name: [] for name in table}
            for fn, mod, shared in table.values():
                once(fn, mod, L, bw, shared)                     # warm-up (numba cache load, allocations)
            for _ in range(args.repeats):
                for name, (fn, mod, shared) in table.items():
                    times[name].append(once(fn, mod, L, bw, shared))
            for name, ts in times.items():
                rows.append({"L": L, "case": name, "mode": mode, "median_s": statistics.median(ts),
                             "min_s": min(ts), "max_s": max(ts)})
            line = "  ".join(f"{n} {statistics.median(ts):.3f}" for n, ts in times.items())
            print(f"L={L:6d} {mode:16s} {line}", flush=True)
    up2 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {up2}")
    med = {(r["L"], r["case"], r["mode"]): r for r in rows}
    print("\n| L | mode | pair | attnkit s | lucidrains s | attnkit faster by |")
    print("|---:|---|---|---:|---:|---:|")
    for L in sorted({r["L"] for r in rows}):
        for mode in ("forward", "forward_backward"):
            for ours, theirs in PAIRS:
                if (L, ours, mode) not in med:
                    continue
                a, b = med[(L, ours, mode)], med[(L, theirs, mode)]
                print(f"| {L:,} | {mode} | {ours} / {theirs} | {a['median_s']:.3f} | {b['median_s']:.3f} | "
                      f"{b['median_s'] / a['median_s']:.2f}x |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"uptime_before": up, "uptime_after": up2, "argv": sys.argv, "torch": torch.__version__,
                       "attnkit_sparse": src, "git": rev,
                       "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
