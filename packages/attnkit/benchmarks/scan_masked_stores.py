"""List the numba kernels whose machine code stores through a mask (``vmaskmovps`` / ``vmaskmovpd`` and their
integer forms), with the source lines they come from.

A loop that updates an array element by a comparison, ``m[i] = x if x > m[i] else m[i]`` (or stores only under a
condition, ``if not keep[j]: s[j] = -inf``), is vectorised by LLVM into masked stores. AMD's cores run those
several times slower than plain stores: on the development VM (AMD EPYC, Zen 3, AVX2) such a running maximum
took 0.76 ns per element against 0.08 for the same loop writing to another array and 0.13 with ``np.fmax``
(docs/benchmarks.md, "Session 42"). This script runs each mechanism's numba backend on tiny inputs (forward,
backward and a no-grad forward, causal and not), then reads the assembly of every numba kernel the run compiled
in the ``attnkit`` packages, and prints each kernel with masked stores and the source lines they come from.

    NUMBA_CACHE_DIR=$(mktemp -d) python packages/attnkit/benchmarks/scan_masked_stores.py [MECHANISM ...]

An empty numba cache is needed: numba cannot show the assembly of a kernel it loaded from its cache. The
masked loads are counted too (fast on these cores, listed for completeness). Nothing here is a test: what LLVM
emits depends on the CPU numba compiles for.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

MECHANISMS = ("linear", "performer", "rfa", "fast-weight", "local", "bigbird", "longformer", "lsh", "routing",
              "sinkhorn", "adaptive-span")


def _exercise(name: str) -> None:
    """Forward, backward and a no-grad forward of ``name`` on the numba backend, causal and not, two lengths;
    what the mechanism rejects (a causal-only one called without ``causal``) is skipped."""
    import torch

    import attnkit
    from attnkit.errors import AttnkitError

    H, D = 2, 16
    try:
        mod = attnkit.build(name, num_heads=H, head_dim=D, backend="numba")
    except (AttnkitError, TypeError, ValueError):
        mod = attnkit.build(name, backend="numba")
    for causal in (False, True):
        for L in (40, 300):
            q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
            try:
                out = mod(q, k, v, causal=causal)
            except AttnkitError:
                break
            (out[0] if isinstance(out, tuple) else out).sum().backward()
            with torch.no_grad():
                mod(q, k, v, causal=causal)


def _masked(asm: str) -> tuple[list[str], int]:
    """The source lines (``.loc`` file:line) of the masked stores in ``asm``, and the number of masked loads."""
    files: dict[str, str] = {}
    where, stores, loads = "?", [], 0
    for raw in asm.splitlines():
        line = raw.strip()
        if line.startswith(".file"):
            parts = line.split()
            if len(parts) >= 3:
                files[parts[1]] = parts[-1].strip('"')
        elif line.startswith(".loc"):
            parts = line.split()
            where = f"{os.path.basename(files.get(parts[1], '?'))}:{parts[2]}"
        elif "maskmov" in line:
            if line.endswith(")"):          # AT&T: the memory operand last is a store
                stores.append(where)
            else:
                loads += 1
    return stores, loads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mechanisms", nargs="*", default=list(MECHANISMS))
    args = p.parse_args(argv)
    os.environ.setdefault("NUMBA_DEBUGINFO", "1")     # .loc lines in the assembly (set before numba loads)
    import torch
    from numba.core.registry import CPUDispatcher

    torch.manual_seed(0)
    for name in args.mechanisms:
        _exercise(name)
    found = 0
    seen: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # numba warns (and returns nothing) for cached kernels
        for mname, module in sorted(sys.modules.items()):
            if not mname.startswith("attnkit") or module is None:
                continue
            for attr, obj in sorted(vars(module).items()):
                if not isinstance(obj, CPUDispatcher) or id(obj) in seen:
                    continue
                seen.add(id(obj))
                for sig in obj.signatures:
                    try:
                        stores, loads = _masked(obj.inspect_asm(sig))
                    except UserWarning:
                        print(f"{mname}.{attr}: loaded from the numba cache, not inspected "
                              "(run with an empty NUMBA_CACHE_DIR)")
                        continue
                    if stores:
                        found += 1
                        lines = ", ".join(sorted(set(stores)))
                        print(f"{mname}.{attr} {sig[0]}: {len(stores)} masked stores at {lines}; "
                              f"{loads} masked loads")
    print(f"{found} kernel signatures with masked stores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
