"""Relative error ||out - softmax|| / ||softmax|| of informer (causal and not) and luna against exact attention.

float64, B=1, H=2, D=E=64, i.i.d. Gaussian q, k, v with q scaled so the logits have standard
deviation ``std``; two trials (seeds 0, 1), mean printed. Untrained luna (random P) is a
different attention: its figure is the distance, not an approximation quality.
"""

from __future__ import annotations

import subprocess

import torch
import torch.nn.functional as F

import attnkit

torch.set_num_threads(1)
L, H, D = 1024, 2, 64
print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
for std in (0.125, 0.5, 2.0):
    for name, kw, causal in [("informer", {"factor": 5}, False), ("informer", {"factor": 5}, True),
                             ("informer", {"factor": 20}, True), ("luna", {"packed_len": 16}, False),
                             ("luna", {"packed_len": 256}, False)]:
        errs = []
        for seed in (0, 1):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(1, H, L, D, generator=g, dtype=torch.float64) * std
            k, v = (torch.randn(1, H, L, D, generator=g, dtype=torch.float64) for _ in range(2))
            torch.manual_seed(seed)
            extra = {"head_dim": D} if name == "luna" else {}
            attn = attnkit.build(name, **kw, **extra).double()
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            with torch.no_grad():
                out = attn(q, k, v, causal=causal)
            errs.append(float((out - ref).norm() / ref.norm()))
        print(f"std={std:5.3f} {name:9s} {kw!s:20s} causal={causal!s:5} rel.err {sum(errs) / len(errs):.3f}",
              flush=True)
print("uptime after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
