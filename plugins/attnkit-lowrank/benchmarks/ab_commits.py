"""Two versions of attnkit-lowrank in one process, calls interleaved: before/after figures that share one load.

On cores shared with other jobs the load moves wall times by 2x between runs
minutes apart, so a before/after comparison of two separate runs says little.
This script imports the installed ``attnkit_lowrank`` and an older copy of the
package renamed ``attnkit_lowrank_base`` (its imports are relative), builds the
same mechanism from both with the same seed and times them alternately, round
by round, in wall time and this process's CPU time, with SDPA in the same
rounds. It first checks that both give the same outputs and gradients.
Make the base copy with::

    mkdir -p /tmp/base && git archive COMMIT plugins/attnkit-lowrank/src/attnkit_lowrank | tar -x -C /tmp/base
    mv /tmp/base/plugins/attnkit-lowrank/src/attnkit_lowrank /tmp/base/attnkit_lowrank_base
    flock /tmp/attnkit-bench.lock python benchmarks/ab_commits.py --base-dir /tmp/base --impls soft --lengths 16384

Settings as ``bench_lowrank.py`` (float32, one thread unless ``--threads``, B = 1, H = 8, D = 64):
``soft`` stride 64, conv, 20 iterations, k is q (contiguous inputs); ``nystrom``
64 landmarks, 6 iterations and ``linformer`` proj_len 256 (max_length = L) on
head views of (1, L, 512) tensors, as ``bench_external.py``'s attention alone.
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
import torch.nn.functional as F

H, D = 8, 64


def build(pkg: str, name: str, L: int):
    torch.manual_seed(0)
    if name == "soft":
        return importlib.import_module(f"{pkg}.soft.module").SoftAttention(head_dim=D, stride=64, pinv_iterations=20)
    if name == "nystrom":
        return importlib.import_module(f"{pkg}.nystrom.module").NystromAttention(num_landmarks=64, pinv_iterations=6)
    return importlib.import_module(f"{pkg}.linformer.module").LinformerAttention(proj_len=256, max_length=L)


def inputs(name: str, L: int):
    g = torch.Generator().manual_seed(3)
    if name in ("soft", "sdpa"):
        x, v = (torch.randn(1, H, L, D, generator=g).requires_grad_(True) for _ in range(2))
        return (x, v), (lambda: (x, x, v))
    q, k, v = (torch.randn(1, L, H * D, generator=g).requires_grad_(True) for _ in range(3))
    split = lambda t: t.view(1, L, H, D).transpose(1, 2)  # noqa: E731
    return (q, k, v), (lambda: (split(q), split(k), split(v)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-dir", required=True, type=Path)
    p.add_argument("--impls", nargs="+", default=["soft", "nystrom", "linformer"])
    p.add_argument("--lengths", type=int, nargs="+", default=[16384])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--fwd-only", action="store_true", help="time the forward only (no-grad), not forward+backward")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sys.path.insert(0, str(args.base_dir))
    torch.set_num_threads(args.threads)
    up = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    res = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(), "uptime_before": up(), "rows": []}
    print(res["uptime_before"], flush=True)
    for L in args.lengths:
        for name in args.impls:
            leaves, call = inputs(name, L)
            variants = {"base": build("attnkit_lowrank_base", name, L), "new": build("attnkit_lowrank", name, L)}
            if not args.no_sdpa and name == args.impls[0]:
                variants = {"sdpa": None, **variants}
            outs = {}
            for tag, mod in variants.items():
                if mod is None:
                    continue
                o = mod(*call())
                outs[tag] = (o.detach(), torch.autograd.grad(o.sum(), leaves))
            diff = max([(outs["base"][0] - outs["new"][0]).abs().max().item()]
                       + [(a - b).abs().max().item() for a, b in zip(outs["base"][1], outs["new"][1])])
            scale = max(outs["base"][0].abs().max().item(), 1e-30)
            print(f"{name} L={L}: base vs new, largest difference in output and gradients {diff:.2e} "
                  f"(output scale {scale:.2e})", flush=True)
            modes = ("fwd",) if args.fwd_only else ("fwd", "fwd+bwd")
            times = {(tag, mode, clock): [] for tag in variants for mode in modes for clock in ("wall", "cpu")}

            def run(mod, grad, call=call, leaves=leaves):
                q, k, v = call()
                if mod is None:
                    o = F.scaled_dot_product_attention(q, k, v)
                else:
                    o = mod(q, k, v)
                if grad:
                    o.sum().backward()
                    for t in leaves:
                        t.grad = None
                    if mod is not None:
                        mod.zero_grad(set_to_none=True)

            for mod in variants.values():               # warm-up
                with torch.no_grad():
                    run(mod, False)
            for _ in range(args.rounds):
                for mode in modes:
                    for tag, mod in variants.items():
                        w0, c0 = time.perf_counter(), time.process_time()
                        if mode == "fwd":
                            with torch.no_grad():
                                run(mod, False)
                        else:
                            run(mod, True)
                        times[(tag, mode, "wall")].append(time.perf_counter() - w0)
                        times[(tag, mode, "cpu")].append(time.process_time() - c0)
            for (tag, mode, clock), ts in times.items():
                row = {"impl": name, "L": L, "variant": tag, "mode": mode, "clock": clock,
                       "median_s": statistics.median(ts), "min_s": min(ts), "all_s": ts}
                res["rows"].append(row)
                print(f"{name:9s} L={L:6d} {tag:5s} {mode:8s} {clock:4s} median {row['median_s'] * 1e3:9.1f} ms  "
                      f"min {row['min_s'] * 1e3:9.1f} ms", flush=True)
    res["uptime_after"] = up()
    print(res["uptime_after"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
