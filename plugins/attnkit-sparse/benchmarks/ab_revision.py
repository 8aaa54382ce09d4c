"""A/B in one process: a sparse plugin mechanism at a git revision against the working tree.

Runs in separate processes minutes apart drift by 25-35% on the development VM; here the plugin's package as
it was at ``--rev`` is exported (``git archive``) as ``attnkit_sparse_base`` (its custom operators under that
namespace), both versions of the module are built with the same options (those of ``bench_lucidrains.py``)
and called alternately, the order flipped each round, on fresh inputs each call. Reported: each side's
median and the median (quartiles) of the per-round ratio ``base / work`` (above 1: the working tree is
faster). ``--keep-freed-memory``: :func:`attnkit.cpu_memory.keep_freed_memory` first, as ``bench_lucidrains.py``.
The core package (``attnkit``) is the working tree's for both sides, except with ``--core-helpers``:
the core's numba helper modules (``attnkit.numba_prefetch``, ``numba_panel``, ``numba_vexp``, ``numba_vreduce``) as
they were at ``--rev``
then go into the exported package, and its kernels import those copies (for A/B runs of a change to them).

    python plugins/attnkit-sparse/benchmarks/ab_revision.py --rev e947eeb --mechanism routing \\
        --length 16384 --mode fwdbwd --rounds 15

The content-based ``routing``, ``lsh`` and ``sinkhorn`` run with ``bench_lucidrains.py``'s options; the position-based
``local`` (window 256) and ``bigbird`` (the defaults) run on the block-sparse engine, ``--causal`` for a causal
call.

Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import attnkit

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "packages" / "attnkit" / "benchmarks"))
from ab_common import alternate, repo_root, summary  # noqa: E402
from ab_common import export as export_package  # noqa: E402

PKG = "plugins/attnkit-sparse/src/attnkit_sparse"
MODULES = {"routing": "routing.attention", "lsh": "lsh.attention", "local": "patterns.local",
           "bigbird": "patterns.random_", "sinkhorn": "sinkhorn.attention"}


CORE_HELPERS = ("numba_prefetch", "numba_panel", "numba_vexp", "numba_vreduce")


def export(rev: str, dest: Path, core_helpers: bool = False) -> None:
    base = export_package(rev, PKG, dest, "attnkit_sparse_base", namespace_file="engine/numba_ops.py")
    if not core_helpers:
        return
    root = repo_root()
    for name in CORE_HELPERS:
        src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:packages/attnkit/src/attnkit/{name}.py"],
                             capture_output=True, text=True)
        if src.returncode == 0:
            text = src.stdout
            for other in CORE_HELPERS:         # the helpers' imports of each other
                text = text.replace(f"from .{other} import", f"from ._core_{other} import")
            (base / f"_core_{name}.py").write_text(text)
    for path in base.rglob("*.py"):
        text = path.read_text()
        for name in CORE_HELPERS:
            text = text.replace(f"from attnkit.{name} import", f"from attnkit_sparse_base._core_{name} import")
        path.write_text(text)


def options(mech: str, L: int) -> dict:
    if mech == "lsh":
        return {"bucket_size": 64, "n_hashes": 4, "seed": 0}
    if mech == "local":
        return {"window": 256}
    if mech == "bigbird":
        return {}
    if mech == "sinkhorn":
        return {"block_size": 64, "num_heads": 8, "head_dim": 64}
    return {"num_clusters": max(1, L // 128), "num_heads": 8, "head_dim": 64}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", required=True)
    p.add_argument("--mechanism", choices=sorted(MODULES), default="routing")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--mode", choices=["fwd", "fwdbwd"], default="fwdbwd")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--causal", action="store_true", help="call with causal=True")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--core-helpers", action="store_true",
                   help="the base side uses the core's numba helper modules as they were at --rev")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="call attnkit.cpu_memory.keep_freed_memory() first (process-wide: both sides alike)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kept = False
    if args.keep_freed_memory:
        from attnkit.cpu_memory import keep_freed_memory
        kept = keep_freed_memory()
    tmp = Path(tempfile.mkdtemp(prefix="attnkit-ab-"))
    export(args.rev, tmp, args.core_helpers)
    sys.path.insert(0, str(tmp))
    mech, L, grad = args.mechanism, args.length, args.mode == "fwdbwd"
    ref = attnkit.build(mech, **options(mech, L))     # the working tree's, for its spec and class name
    mods = {}
    for side, pkg in (("base", "attnkit_sparse_base"), ("work", "attnkit_sparse")):
        cls = getattr(importlib.import_module(f"{pkg}.{MODULES[mech]}"), type(ref).__name__)
        torch.manual_seed(0)
        m = cls(**options(mech, L))
        m.spec = ref.spec            # built outside the registry: the spec declares routing's auxiliary loss
        m.train(grad)
        mods[side] = m
    shared = mech == "lsh"

    def run(m: torch.nn.Module) -> float:
        q, k, v = (torch.randn(1, 8, L, 64, requires_grad=grad) for _ in range(3))
        if shared:
            k = q
        kw = {"causal": True} if args.causal else {}
        t0 = time.perf_counter()
        if grad:
            out = m(q, k, v, **kw)
            out.backward(torch.ones_like(out))
            attnkit.clear_aux_losses(m)
        else:
            with torch.no_grad():
                m(q, k, v, **kw)
        return time.perf_counter() - t0

    for m in mods.values():
        run(m)
        run(m)
    ts = alternate(lambda side: run(mods[side]), args.rounds)
    mode = args.mode + (" causal" if args.causal else "")
    print(f"# {mech} module {mode}, L = {L}, B = 1, H = 8, D = E = 64, float32, {args.threads} thread(s), "
          f"base {args.rev}{' (with its core helpers)' if args.core_helpers else ''} against the working tree"
          f"{'; freed memory kept' if kept else ''}")
    print(summary(ts))


if __name__ == "__main__":
    main()
