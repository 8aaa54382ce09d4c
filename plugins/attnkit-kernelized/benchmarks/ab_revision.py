"""A/B in one process: this plugin's code at a git revision against the working tree, calls alternated.

Separate processes run minutes apart, and this VM's speed drifts by 25-35% within minutes, so two runs of the
same code can differ more than the change being measured. Here the plugin's package as it was at ``--rev``
is exported (``git archive``) into a temporary folder as ``attnkit_kernelized_base`` (its custom operators
registered under that namespace), both versions are built with the same seed, and every round calls both,
the order flipped each round. Reported: each side's median and the median (quartiles) of the per-round
ratio ``base / work`` (above 1: the working tree is faster). The core package (``attnkit``) is the working
tree's for both sides: a change to the core is not measured here.

    python plugins/attnkit-kernelized/benchmarks/ab_revision.py --rev 3dd7472 --mechanism linear \\
        --length 8192 --mode fwd --threads 2 --rounds 61 [--fused-only] [--keep-freed-memory]

``--mechanism fast-weight`` runs the module with its defaults (DPFP, 128 features, a learned beta).
``--fused-only`` calls the fused no-grad forward kernel (``linear`` or ``performer``'s ``numba_fused``)
directly instead of the module. ``--keep-freed-memory`` calls :func:`attnkit.cpu_memory.keep_freed_memory` first
(both sides alike: glibc then reuses a step's pages instead of faulting them in again).

Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "attnkit" / "benchmarks"))
from ab_common import alternate, export, summary  # noqa: E402

PKG = "plugins/attnkit-kernelized/src/attnkit_kernelized"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", required=True)
    p.add_argument("--mechanism", choices=["linear", "performer", "fast-weight"], default="linear")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--fused-only", action="store_true")
    p.add_argument("--keep-freed-memory", action="store_true")
    args = p.parse_args()
    if args.fused_only and args.mechanism == "fast-weight":
        p.error("--fused-only: linear and performer only (fast-weight's fused kernel is new in session 64)")
    if args.keep_freed_memory:
        from attnkit.cpu_memory import keep_freed_memory
        keep_freed_memory()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-ab-"))
    export(args.rev, PKG, tmp, "attnkit_kernelized_base", namespace_file="_ops.py")
    sys.path.insert(0, str(tmp))
    mech, L = args.mechanism, args.length
    torch.manual_seed(1)
    grad = args.mode == "fwdbwd"
    q, k, v = (torch.randn(1, 8, L, 64, requires_grad=grad) for _ in range(3))
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(2)) * 0.125 ** 0.5   # performer's projection
    calls = {}
    for side, pkg in (("base", "attnkit_kernelized_base"), ("work", "attnkit_kernelized")):
        if args.fused_only:
            fused = importlib.import_module(f"{pkg}.{mech}.numba_fused").fused_causal
            if mech == "linear":
                calls[side] = (lambda f: lambda: f(q, k, v, 1.0, None, None, None, 32)[0])(fused)
            else:
                calls[side] = (lambda f: lambda: f(q, k, v, w, 0.125, None, None, None, 32)[0])(fused)
            continue
        mod = importlib.import_module(f"{pkg}.{mech.replace('-', '_')}.module")
        cls = {"performer": "PerformerAttention", "linear": "LinearAttention", "fast-weight": "FastWeightAttention"}
        cls = getattr(mod, cls[mech])
        torch.manual_seed(0)
        kw = {"num_features": 256} if mech == "performer" else {}
        m = cls(num_heads=8, head_dim=64, backend="numba", **kw)

        def call(m=m):  # noqa: ANN202
            if not grad:
                with torch.no_grad():
                    return m(q, k, v, causal=True)
            out = m(q, k, v, causal=True)
            out.sum().backward()
            return out.detach()
        calls[side] = call
    a, b = calls["base"](), calls["work"]()
    print(f"# {mech} {'fused kernel' if args.fused_only else 'module'} {args.mode}, L = {L}, B = 1, H = 8, "
          f"D = E = 64, float32, causal, {args.threads} thread(s), base {args.rev} against the working tree"
          f"{', freed memory kept' if args.keep_freed_memory else ''}")
    print(f"largest difference of the outputs: {(a - b).abs().max().item():.3g}")

    def timed(side: str) -> float:
        t0 = time.perf_counter()
        calls[side]()
        return time.perf_counter() - t0

    print(summary(alternate(timed, args.rounds), digits=2))


if __name__ == "__main__":
    main()
