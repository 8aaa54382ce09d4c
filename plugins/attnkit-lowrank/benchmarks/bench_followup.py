"""CPU timing of the follow-up mechanisms (``informer`` causal, ``luna``, ``poolingformer``) against SDPA in one run.

float32, B=1, H=8, D=E=64, self-attention, causal and not; median forward and
forward+backward seconds of ``--repeats`` runs after one warm-up. Paper
defaults: informer factor 5; luna packed_len 16 (causal chunk 64);
poolingformer window 128, pool_window 512, pool_size 5, pool_stride 4.
Run alone, e.g.::

    flock /tmp/attnkit-bench.lock python benchmarks/bench_followup.py --out benchmarks/results/bench_followup.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit

H, D = 8, 64


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _median(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    impls = {
        "sdpa": None,
        "informer": attnkit.build("informer", factor=5),
        "luna": attnkit.build("luna", head_dim=D, packed_len=16, chunk_size=64),   # as in the recorded run
        "poolingformer": attnkit.build("poolingformer"),
    }
    rows = []
    print("uptime before:", _uptime(), flush=True)
    for L in a.lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, H, L, D, generator=g) for _ in range(3))
        for causal in (False, True):
            for name, attn in impls.items():
                def fwd(attn=attn, causal=causal, grad=False, qkv=(q, k, v)):
                    qq, kk, vv = (t.detach().requires_grad_(grad) for t in qkv)
                    out = (F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal) if attn is None
                           else attn(qq, kk, vv, causal=causal))
                    if grad:
                        out.sum().backward()

                def run_fwd(fwd=fwd):
                    with torch.no_grad():
                        fwd()
                f = _median(run_fwd, a.repeats)
                fb = _median(lambda fwd=fwd: fwd(grad=True), a.repeats)
                rows.append({"L": L, "causal": causal, "impl": name, "fwd_s": f, "fwd_bwd_s": fb})
                print(f"L={L:6d} causal={causal!s:5} {name:14s} fwd {f * 1e3:9.1f} ms  fwd+bwd {fb * 1e3:9.1f} ms",
                      flush=True)
    print("uptime after:", _uptime(), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"torch": torch.__version__, "threads": a.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
