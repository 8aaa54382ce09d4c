"""lsh, routing and sinkhorn with ``backend="triton"`` on a CUDA GPU against the same module on ``backend="torch"``
(a short check, about a minute with compiles).

The pair shares one state_dict and runs in eval mode on the same float32 CUDA inputs, so the hashing, the clusters
and the sorting (torch ops on both sides) pick the same positions; what differs is the attention inside the
buckets, clusters and blocks: the engine's triton kernels through ``attend_plan`` against the torch backend.
Causal and non-causal, key padding with NaN at the padded keys (lsh and routing, which declare it), L not a
multiple of the bucket or block. Errors: ``rel = max|err| / max|ref|`` on the output and every input gradient of
``sum(out * w)``; passes at 2e-3 (the triton products may use TF32). The CPU test of the same pairing, in float64
under the interpreter, is ``tests/test_content_triton.py``. Prints one line per case, exits 1 when any fails.

Usage (repository root)::

    python3 plugins/attnkit-sparse/benchmarks/check_content_gpu.py
    TRITON_INTERPRET=1 python3 plugins/attnkit-sparse/benchmarks/check_content_gpu.py --device cpu --length 70
"""

from __future__ import annotations

import argparse
import sys

#: name -> (options, shared-QK, takes key padding)
CASES = {
    "lsh": (dict(bucket_size=32, n_hashes=2, seed=3), True, True),
    "routing": (dict(num_clusters=4), False, True),
    "sinkhorn": (dict(block_size=32), False, False),
}
TOL = 2e-3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--length", type=int, default=300, help="L (not a multiple of the bucket or block)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args(argv)

    import torch

    import attnkit
    from attnkit_sparse.engine import triton_ops

    calls: list[int] = []
    real = triton_ops.attend

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    triton_ops.attend = counting
    dev, L, H, D = torch.device(args.device), args.length, args.heads, args.head_dim
    failed = 0
    for name, (opts, shared_qk, padding) in CASES.items():
        opts = dict(opts, num_heads=H, head_dim=D)
        for causal in (False, True):
            torch.manual_seed(0)
            tri = attnkit.build(name, backend="triton", **opts).to(dev).eval()
            ref = attnkit.build(name, backend="torch", **opts).to(dev).eval()
            ref.load_state_dict(tri.state_dict())
            g = torch.Generator().manual_seed(1)
            q, k, v = (torch.randn(2, H, L, D, generator=g).to(dev) for _ in range(3))
            kpm = None
            if padding:
                kpm = torch.ones(2, L, dtype=torch.bool, device=dev)
                kpm[1, -37:] = False
                k = k.masked_fill(~kpm[:, None, :, None], float("nan")) if not shared_qk else k
                v = v.masked_fill(~kpm[:, None, :, None], float("nan"))
            w = torch.randn(2, H, L, D, generator=torch.Generator().manual_seed(2)).to(dev)
            res = []
            n0 = len(calls)
            try:
                for mod in (tri, ref):
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    kk = leaves[0] if shared_qk else leaves[1]
                    out = mod(leaves[0], kk, leaves[2], causal=causal, key_padding_mask=kpm)
                    wrt = [leaves[0], leaves[2]] if shared_qk else leaves
                    grads = torch.autograd.grad((out * w).sum(), wrt)
                    res.append([out, *grads])
                reached = len(calls) > n0
                errs = []
                for a, b in zip(*res):
                    a, b = a.double().nan_to_num(nan=1e30), b.double().nan_to_num(nan=1e30)
                    errs.append(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
                ok = reached and max(errs) <= TOL and all(torch.isfinite(t).all() for t in res[0])
                line = (f"{name:9s} causal={causal!s:5s} L={L} triton_reached={reached} "
                        f"rel(out, grads)={', '.join(f'{e:.2e}' for e in errs)} {'ok' if ok else 'FAIL'}")
            except Exception as exc:  # noqa: BLE001 - reported, the other cases still run
                ok, line = False, f"{name:9s} causal={causal!s:5s} L={L} ERROR {type(exc).__name__}: {str(exc)[:300]}"
            failed += not ok
            print(line, flush=True)
    print(f"{failed} case(s) failed" if failed else "all cases passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
