"""A/B in one process: ``adaptive-span`` on its numba kernels at a git revision against the working tree.

Separate runs minutes apart drift by 25-35% on the development VM; here the plugin's package as it was at
``--rev`` is exported (``git archive``) as ``attnkit_adaptive_base``, both versions of the module are built
alike (``max_span = L``, every head's span ``--span``, ramp 32, backend ``numba``) and called alternately,
the order flipped each round, on fresh inputs each call (causal, B = 1, H = 8, D = 64, float32). Reported:
each side's median and the median (quartiles) of the per-round ratio ``base / work`` (above 1: the working
tree is faster). The core package (``attnkit``) is the working tree's for both sides.

    python plugins/attnkit-adaptive/benchmarks/ab_revision.py --rev HEAD --length 8192 --mode fwd

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

import attnkit

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "attnkit" / "benchmarks"))
from ab_common import alternate, export, summary  # noqa: E402

PKG = "plugins/attnkit-adaptive/src/attnkit_adaptive"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", required=True)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--span", type=float, default=64.0, help="every head's span in positions")
    p.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwd")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-ab-"))
    export(args.rev, PKG, tmp, "attnkit_adaptive_base")
    sys.path.insert(0, str(tmp))
    L, grad = args.length, args.mode == "fwdbwd"
    opts = {"num_heads": 8, "max_span": L, "ramp": 32.0, "init_span": args.span, "backend": "numba"}
    ref = attnkit.build("adaptive-span", **opts)     # the working tree's, for its spec
    mods = {}
    for side, pkg in (("base", "attnkit_adaptive_base"), ("work", "attnkit_adaptive")):
        cls = getattr(importlib.import_module(f"{pkg}.span.module"), type(ref).__name__)
        m = cls(**opts)
        m.spec = ref.spec
        m.train(grad)
        mods[side] = m

    def run(m: torch.nn.Module) -> float:
        q, k, v = (torch.randn(1, 8, L, 64, requires_grad=grad) for _ in range(3))
        t0 = time.perf_counter()
        if grad:
            out = m(q, k, v, causal=True)
            out.backward(torch.ones_like(out))
            attnkit.clear_aux_losses(m)
        else:
            with torch.no_grad():
                m(q, k, v, causal=True)
        return time.perf_counter() - t0

    for m in mods.values():
        run(m)
        run(m)
    ts = alternate(lambda side: run(mods[side]), args.rounds)
    print(f"# adaptive-span (numba) {args.mode} causal, span {args.span:g}, L = {L}, B = 1, H = 8, D = E = 64, "
          f"float32, {args.threads} thread(s), base {args.rev} against the working tree")
    print(summary(ts))


if __name__ == "__main__":
    main()
