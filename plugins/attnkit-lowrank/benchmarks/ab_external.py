"""lucidrains' packages, an older attnkit-lowrank and this one, alternated in one process: the attention alone.

The same measurement as ``bench_external.py --skip-layers`` (the public layer with its
projections replaced by fixed (1, L, 512) tensors and its output projection by the
identity; attnkit's attention on the same tensors split into heads and merged back,
linformer with the public E and F), but the three implementations take turns round by
round, so on cores shared with other jobs they see the same load. First checks that the
three give the same outputs and gradients. Run in the benchmark venv, with this
checkout first on the path and the base copy made as for ``ab_commits.py``::

    mkdir -p /tmp/base && git archive COMMIT plugins/attnkit-lowrank/src/attnkit_lowrank | tar -x -C /tmp/base
    mv /tmp/base/plugins/attnkit-lowrank/src/attnkit_lowrank /tmp/base/attnkit_lowrank_base
    PYTHONPATH=packages/attnkit/src:plugins/attnkit-lowrank/src flock /tmp/attnkit-bench.lock \\
        /work/venvs/bench-s12c/bin/python plugins/attnkit-lowrank/benchmarks/ab_external.py --base-dir /tmp/base

nystrom: 64 landmarks, 6 iterations, no convolution residual; linformer: proj_len 256,
E and F shared by the heads, no key-value sharing; float32, B = 1, H = 8, D = 64.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from linformer import LinformerSelfAttention
from nystrom_attention import NystromAttention as PublicNystrom

H, DH, DIM = 8, 64, 512


class Cached(torch.nn.Module):
    """Stands in for a projection: returns a fixed tensor."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


def build(pkg: str, name: str, L: int):
    torch.manual_seed(0)
    if name == "nystrom":
        return importlib.import_module(f"{pkg}.nystrom.module").NystromAttention(num_landmarks=64, pinv_iterations=6)
    return importlib.import_module(f"{pkg}.linformer.module").LinformerAttention(proj_len=256, max_length=L)


def compare(name: str, L: int, rounds: int, res: dict) -> None:
    """Check, then time public / base / new for ``name`` at length ``L``, alternated; rows into ``res``."""
    split = lambda t: t.view(1, L, H, DH).transpose(1, 2)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, L, DIM, generator=g).requires_grad_(True) for _ in range(3))
    torch.manual_seed(0)
    if name == "nystrom":
        pub = PublicNystrom(dim=DIM, dim_head=DH, heads=H, num_landmarks=64, pinv_iterations=6, residual=False)
        pub.to_qkv = Cached(torch.cat([q, k, v], -1))
    else:
        pub = LinformerSelfAttention(dim=DIM, seq_len=L, k=256, heads=H, dim_head=DH)
        pub.to_q, pub.to_k, pub.to_v = Cached(q), Cached(k), Cached(v)
    pub.to_out = torch.nn.Identity()
    x = torch.zeros(1, L, DIM)
    mods = {"base": build("attnkit_lowrank_base", name, L), "new": build("attnkit_lowrank", name, L)}
    if name == "linformer":
        for mod in mods.values():
            with torch.no_grad():
                mod.proj_k.copy_(pub.proj_k.T[None])
                mod.proj_v.copy_(pub.proj_v.T[None])
    calls = {"public": lambda: pub(x)}
    for tag, mod in mods.items():
        calls[tag] = lambda mod=mod: mod(split(q), split(k), split(v)).transpose(1, 2).reshape(1, L, DIM)
    outs = {}
    ramp = torch.linspace(0, 1, L)[:, None]
    for tag, call in calls.items():
        o = call()
        outs[tag] = (o.detach(), torch.autograd.grad((o * ramp).sum(), (q, k, v)))
    for tag in mods:
        diff = max([(outs[tag][0] - outs["public"][0]).abs().max().item()]
                   + [(a - b).abs().max().item() for a, b in zip(outs[tag][1], outs["public"][1])])
        print(f"{name} {tag} vs public: largest difference in output and gradients {diff:.2e}", flush=True)
    del outs

    def run(call, grad):
        if grad:
            call().sum().backward()
            for t in (q, k, v):
                t.grad = None
        else:
            with torch.no_grad():
                call()

    times = {(t, mo, cl): [] for t in calls for mo in ("fwd", "fwd+bwd") for cl in ("wall", "cpu")}
    for call in calls.values():                    # warm-up
        run(call, False)
        run(call, True)
    for _ in range(rounds):
        for mode in ("fwd", "fwd+bwd"):
            for tag, call in calls.items():
                w0, c0 = time.perf_counter(), time.process_time()
                run(call, mode == "fwd+bwd")
                times[(tag, mode, "wall")].append(time.perf_counter() - w0)
                times[(tag, mode, "cpu")].append(time.process_time() - c0)
    for mode in ("fwd", "fwd+bwd"):
        for clock in ("wall", "cpu"):
            med = {t: statistics.median(times[(t, mode, clock)]) for t in calls}
            row = {"impl": name, "L": L, "mode": mode, "clock": clock, "median_s": med,
                   "all_s": {t: times[(t, mode, clock)] for t in calls},
                   "speedup_base": med["public"] / med["base"], "speedup_new": med["public"] / med["new"]}
            res["rows"].append(row)
            print(f"{name:9s} {mode:8s} {clock:4s} public {med['public'] * 1e3:7.1f} ms  base "
                  f"{med['base'] * 1e3:7.1f} ms ({row['speedup_base']:.2f}x)  new {med['new'] * 1e3:7.1f} ms "
                  f"({row['speedup_new']:.2f}x)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-dir", required=True, type=Path)
    p.add_argument("--impls", nargs="+", default=["nystrom", "linformer"])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sys.path.insert(0, str(args.base_dir))
    torch.set_num_threads(args.threads)
    import attnkit_lowrank
    L = args.length
    up = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    res = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(), "new": attnkit_lowrank.__file__,
           "uptime_before": up(), "rows": []}
    print(res["uptime_before"], "| new:", res["new"], flush=True)
    for name in args.impls:
        compare(name, L, args.rounds, res)
    res["uptime_after"] = up()
    print(res["uptime_after"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
