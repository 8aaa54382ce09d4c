"""lucidrains' ``reformer-pytorch`` LSHAttention at bench_content.py's settings (a separate environment).

Never a dependency of attnkit: install it in its own venv (``pip install -c constraints.txt
torch==2.13.0 reformer-pytorch==1.4.4``) and run this there. float32, B·H = 8 sequences of D = 64
(its LSHAttention folds heads into the batch), shared-QK, ``n_hashes`` 4, ``bucket_size`` 64,
bidirectional; forward (no_grad) and forward+backward, one warm-up then ``--repeats`` calls.

    flock /tmp/attnkit-bench.lock /work/venvs/bench-i11/bin/python \\
        plugins/attnkit-sparse/benchmarks/bench_reformer_pytorch.py --lengths 1024,4096,16384 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch
from reformer_pytorch.reformer_pytorch import LSHAttention


def run(attn, L, backward):
    g = torch.Generator().manual_seed(0)
    qk = torch.randn(8, L, 64, generator=g).requires_grad_(backward)
    v = torch.randn(8, L, 64, generator=g).requires_grad_(backward)
    t = time.perf_counter()
    if backward:
        out = attn(qk, v)[0]
        out.backward(torch.ones_like(out))
    else:
        with torch.no_grad():
            attn(qk, v)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(up)
    rows = []
    for L in [int(x) for x in args.lengths.split(",")]:
        torch.manual_seed(0)
        attn = LSHAttention(bucket_size=64, n_hashes=4, causal=False)
        row = {"L": L, "case": "reformer-pytorch"}
        for mode, bw in (("forward", False), ("forward_backward", True)):
            run(attn, L, bw)
            ts = [run(attn, L, bw) for _ in range(args.repeats)]
            row[mode] = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
        rows.append(row)
        print(f"L={L:6d} reformer-pytorch fwd {row['forward']['median_s']:.3f} s  "
              f"fwd+bwd {row['forward_backward']['median_s']:.3f} s", flush=True)
    up2 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(up2)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"uptime_before": up, "uptime_after": up2, "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
