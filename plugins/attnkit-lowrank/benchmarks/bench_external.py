"""lucidrains' ``nystrom-attention`` and ``linformer`` against attnkit's ``nystrom`` and ``linformer``, same run.

Runs in a separate environment that has those two packages (never a dependency of
attnkit-lowrank)::

    python3 -m venv /work/venvs/bench-i12
    /work/venvs/bench-i12/bin/pip install -c constraints.txt torch==2.13.0 nystrom-attention linformer \
        -e packages/attnkit -e plugins/attnkit-lowrank
    flock /tmp/attnkit-bench.lock /work/venvs/bench-i12/bin/python plugins/attnkit-lowrank/benchmarks/bench_external.py

Both sides are whole layers with the same weights: attnkit's
``MultiHeadAttention`` gets the public layer's q/k/v and output projections (and,
for Linformer, its E and F), dim 512, 8 heads of 64, B = 1, float32:

* nystrom: 64 landmarks, 6 iterations, no convolution residual (``residual=False``);
* linformer: proj_len 256, E and F shared by the heads, no key-value sharing.

It reports median forward and forward+backward seconds at each L (and the four
projections alone, so the attention part of each layer can be read off), the attention
alone measured directly (the public layer with its projections replaced by fixed tensors
and its output projection by the identity, attnkit's attention on the same tensors split
into heads), and at L=4096
(float64) the relative error of each layer's output against the exact layer (the same
projections around softmax attention), side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from linformer import LinformerSelfAttention
from nystrom_attention import NystromAttention

import attnkit

DIM, H, DH = 512, 8, 64


#: wall time, or with ``--clock cpu`` this process's CPU time (one thread on shared cores: leaves out descheduling)
CLOCK = time.perf_counter


def timed(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return statistics.median(ts)


def pair(name: str, L: int):
    """(public layer, attnkit layer with the same weights)."""
    torch.manual_seed(0)
    if name == "nystrom":
        pub = NystromAttention(dim=DIM, dim_head=DH, heads=H, num_landmarks=64, pinv_iterations=6, residual=False)
        ours = attnkit.MultiHeadAttention(DIM, H, "nystrom", num_landmarks=64, pinv_iterations=6)
        wq, wk, wv = pub.to_qkv.weight.chunk(3, 0)
        out = pub.to_out[0]
    else:
        pub = LinformerSelfAttention(dim=DIM, seq_len=L, k=256, heads=H, dim_head=DH)
        ours = attnkit.MultiHeadAttention(DIM, H, "linformer", proj_len=256, max_length=L)
        wq, wk, wv = pub.to_q.weight, pub.to_k.weight, pub.to_v.weight
        out = pub.to_out
        with torch.no_grad():
            ours.attention.proj_k.copy_(pub.proj_k.T[None])
            ours.attention.proj_v.copy_(pub.proj_v.T[None])
    with torch.no_grad():
        for proj, w in ((ours.q_proj, wq), (ours.k_proj, wk), (ours.v_proj, wv)):
            proj.weight.copy_(w)
            proj.bias.zero_()
        ours.out_proj.weight.copy_(out.weight)
        ours.out_proj.bias.copy_(out.bias)
    return pub.eval(), ours.eval()


class Cached(torch.nn.Module):
    """Stands in for a projection: returns a fixed tensor, so a layer's time is its attention alone."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


def attention_only(name: str, pub, ours: attnkit.MultiHeadAttention, L: int, grad: bool):
    """(public call, attnkit call) that time the attention alone: the same (1, L, 512) q, k, v on both sides.

    The public layer's projections are replaced by :class:`Cached` tensors and its output
    projection by the identity; attnkit's attention gets the same tensors split into
    heads the way ``MultiHeadAttention`` splits them (views) and merged back.
    """
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, L, DIM, generator=g).requires_grad_(grad) for _ in range(3))
    if name == "nystrom":
        pub.to_qkv = Cached(torch.cat([q, k, v], -1))
    else:
        pub.to_q, pub.to_k, pub.to_v = Cached(q), Cached(k), Cached(v)
    pub.to_out = torch.nn.Identity()
    split = lambda t: t.view(1, L, H, DH).transpose(1, 2)  # noqa: E731

    def ours_call():
        return ours.attention(split(q), split(k), split(v)).transpose(1, 2).reshape(1, L, DIM)

    x = torch.zeros(1, L, DIM)
    return (lambda: pub(x)), ours_call, (q, k, v)


def one_pass(call, grad: bool, inputs):
    """A callable that runs ``call()`` once: without autograd, or (``grad``) forward and backward of its sum, the
    ``inputs``' gradients cleared after."""
    def run():
        if not grad:
            with torch.no_grad():
                call()
        else:
            call().sum().backward()
            for x_ in inputs:
                x_.grad = None
    return run


def exact(ours: attnkit.MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    split = lambda t: t.view(1, -1, H, DH).transpose(1, 2)  # noqa: E731
    q, k, v = split(ours.q_proj(x)), split(ours.k_proj(x)), split(ours.v_proj(x))
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, -1, DIM)
    return ours.out_proj(o)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--error-length", type=int, default=4096)
    p.add_argument("--out", type=Path)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--skip-layers", action="store_true", help="the attention alone only (no whole layers)")
    args = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    up = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    res = {"command": " ".join(sys.argv), "threads": args.threads, "torch": torch.__version__, "clock": args.clock,
           "uptime_before": up(), "time": [], "error": []}
    print(res["uptime_before"], flush=True)
    for name in ("nystrom", "linformer"):
        for L in ([] if args.skip_layers else args.lengths):
            pub, ours = pair(name, L)
            x = torch.randn(1, L, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
            for mode in ("fwd", "fwd+bwd"):
                t = {}

                def proj(mode=mode, x=x, ours=ours):
                    # the projections alone (the same four 512 x 512 products on both sides)
                    if mode == "fwd":
                        with torch.no_grad():
                            ours.out_proj(ours.q_proj(x) + ours.k_proj(x) + ours.v_proj(x))
                    else:
                        ours.out_proj(ours.q_proj(x) + ours.k_proj(x) + ours.v_proj(x)).sum().backward()
                        x.grad = None
                        ours.zero_grad(set_to_none=True)
                t["projections"] = timed(proj, args.repeats)
                for side, layer in (("public", pub), ("attnkit", ours)):
                    def run(layer=layer, mode=mode, x=x):
                        if mode == "fwd":
                            with torch.no_grad():
                                layer(x)
                        else:
                            layer(x).sum().backward()
                            x.grad = None
                            layer.zero_grad(set_to_none=True)
                    t[side] = timed(run, args.repeats)
                core_pub, core_ours = t["public"] - t["projections"], t["attnkit"] - t["projections"]
                row = {"impl": name, "L": L, "mode": mode, "public_s": t["public"], "attnkit_s": t["attnkit"],
                       "speedup": t["public"] / t["attnkit"], "projections_s": t["projections"],
                       "core_speedup_estimate": core_pub / core_ours if core_ours > 0 else None}
                res["time"].append(row)
                print(f"{name:9s} L={L:6d} {mode:8s} public {t['public'] * 1e3:8.1f} ms  attnkit "
                      f"{t['attnkit'] * 1e3:8.1f} ms  {row['speedup']:.2f}x  (projections alone "
                      f"{t['projections'] * 1e3:.1f} ms; attention part {core_pub * 1e3:.1f} vs "
                      f"{core_ours * 1e3:.1f} ms)",
                      flush=True)
        for L in args.lengths:
            for mode in ("fwd", "fwd+bwd"):
                pub, ours = pair(name, L)
                grad = mode == "fwd+bwd"
                calls = attention_only(name, pub, ours, L, grad)
                t = {}
                for side, call in (("public", calls[0]), ("attnkit", calls[1])):
                    t[side] = timed(one_pass(call, grad, calls[2]), args.repeats)
                row = {"impl": name, "L": L, "mode": mode, "part": "attention alone", "public_s": t["public"],
                       "attnkit_s": t["attnkit"], "speedup": t["public"] / t["attnkit"]}
                res["time"].append(row)
                print(f"{name:9s} L={L:6d} {mode:8s} attention alone: public {t['public'] * 1e3:8.1f} ms  "
                      f"attnkit {t['attnkit'] * 1e3:8.1f} ms  {row['speedup']:.2f}x", flush=True)
        L = args.error_length
        pub, ours = pair(name, L)
        pub, ours = pub.double(), ours.double()
        for std in (1.0, 4.0):
            x = torch.randn(1, L, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * std
            with torch.no_grad():
                ref = exact(ours, x)
                e_pub = ((pub(x) - ref).norm() / ref.norm()).item()
                e_ours = ((ours(x) - ref).norm() / ref.norm()).item()
            res["error"].append({"impl": name, "L": L, "x_std": std, "public": e_pub, "attnkit": e_ours})
            print(f"{name:9s} L={L} x std {std}: error vs exact layer: public {e_pub:.4f}  attnkit {e_ours:.4f}",
                  flush=True)
    res["uptime_after"] = up()
    print(res["uptime_after"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
