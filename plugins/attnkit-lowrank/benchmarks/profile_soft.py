"""Forward profile of ``soft`` step by step at one length (CPU, float32, one thread, H = 8, D = 64, stride 64).

Times each step of ``SoftAttention`` on its own (bottleneck tokens, the m x m kernel
A, the L x m kernel P_k, the 20 Newton iterations (as products, and from one
eigendecomposition as the module runs them on CPU), P_k^T V, P (Z w)), then the whole
forward and forward+backward, and SDPA's forward once, with the load average before
and after. Run it alone::

    flock /tmp/attnkit-bench.lock python benchmarks/profile_soft.py 16384
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from attnkit_lowrank.common import newton_pinv, newton_pinv_sym
from attnkit_lowrank.soft.module import gaussian_kernel

import attnkit


def timed_ms(fn, repeats: int = 3) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main(L: int) -> None:
    torch.set_num_threads(1)
    H, D = 8, 64
    torch.manual_seed(0)
    attn = attnkit.build("soft", head_dim=D, stride=64)
    x, v = torch.randn(1, H, L, D), torch.randn(1, H, L, D)
    print("load", open("/proc/loadavg").read().strip())
    with torch.no_grad():
        scale = D ** -0.5
        kb = attn.bottleneck_tokens(x)
        a = gaussian_kernel(kb, kb, scale)
        pk = gaussian_kernel(x, kb, scale)
        z = newton_pinv(a, 20)
        w = pk.transpose(-1, -2) @ v
        steps = {
            "bottleneck": lambda: attn.bottleneck_tokens(x),
            "A": lambda: gaussian_kernel(kb, kb, scale),
            "P_k": lambda: gaussian_kernel(x, kb, scale),
            "newton (20)": lambda: newton_pinv(a, 20),
            "newton eigh": lambda: newton_pinv_sym(a, 20),      # what the module runs on CPU
            "P_k^T V": lambda: pk.transpose(-1, -2) @ v,
            "P (Z w)": lambda: pk @ (z @ w),
            "whole forward": lambda: attn(x, x, v),
        }
        for name, fn in steps.items():
            print(f"{name:14s} {timed_ms(fn):8.1f} ms")
    xg, vg = x.clone().requires_grad_(True), v.clone().requires_grad_(True)
    print(f"{'fwd+bwd':14s} {timed_ms(lambda: attn(xg, xg, vg).sum().backward()):8.1f} ms")
    q = torch.randn(1, H, L, D)
    print(f"{'sdpa fwd':14s} {timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, v), 1):8.1f} ms")
    print("load", open("/proc/loadavg").read().strip())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16384)
