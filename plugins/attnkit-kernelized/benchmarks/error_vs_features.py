"""Relative error of `performer` (and its feature maps) against exact softmax attention, by feature count.

q, k, v i.i.d. N(0, std^2), B=2, H=2, L=S=64, D=E=16 (the conformance kit's
error distribution), float64, mean over seeds of the relative Frobenius error
``||out - softmax||_F / ||softmax||_F``. Prints a markdown table; ``--output``
writes JSON.

    python plugins/attnkit-kernelized/benchmarks/error_vs_features.py
"""

from __future__ import annotations

import argparse
import json

import torch

import attnkit
from attnkit.reference import reference_attention


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    p.add_argument("--stds", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--maps", nargs="+", default=["positive", "trig"])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    rows = []
    for std in args.stds:
        for fmap in args.maps:
            for m in args.features:
                for causal in (False, True):
                    errs = []
                    for seed in range(args.seeds):
                        g = torch.Generator().manual_seed(1000 + seed)
                        q, k, v = (torch.randn(2, 2, 64, 16, generator=g, dtype=torch.float64) * std
                                   for _ in range(3))
                        attn = attnkit.build("performer", num_heads=2, head_dim=16, num_features=m,
                                             feature_map=fmap, seed=seed).double()
                        ref = reference_attention(q, k, v, causal=causal)
                        out = attn(q, k, v, causal=causal)
                        errs.append(((out - ref).norm() / ref.norm()).item())
                    rows.append({"std": std, "feature_map": fmap, "num_features": m, "causal": causal,
                                 "mean_rel_error": sum(errs) / len(errs), "max_rel_error": max(errs)})
    print("| input std | feature_map | M | non-causal | causal |")
    print("|---:|---|---:|---:|---:|")
    for std in args.stds:
        for fmap in args.maps:
            for m in args.features:
                nc, c = (next(r for r in rows if r["std"] == std and r["feature_map"] == fmap
                              and r["num_features"] == m and r["causal"] == cz) for cz in (False, True))
                print(f"| {std:g} | {fmap} | {m} | {nc['mean_rel_error']:.3f} | {c['mean_rel_error']:.3f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
