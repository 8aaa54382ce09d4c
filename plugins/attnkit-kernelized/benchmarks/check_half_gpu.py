"""The kernelized modules on float16/bfloat16 inputs on the triton backend (a CUDA check, under a minute on one GPU).

For linear, performer, rfa and fast-weight (and a few options), a float32 module and the same module cast to
the half dtype, called on half inputs with ``backend="triton"``, causal (and non-causal where declared), with
and without key padding (NaN at padded keys, one batch row fully padded): the output and the input gradients
must be in the input dtype and finite, and close to the spec's float64 reference on the upcast half inputs
(``rel = max|err| / max|ref|`` <= 2e-2 bfloat16, 5e-3 float16; the kit's half tolerances are per element).
Performer rows record which causal path ran (``bounded (triton)``: the linear kernels on half features;
``log-space torch``: the float32 form, for key exponents beyond +-60), also on inputs of std 3 and 12 (the
latter beyond the bound). Streaming: ``step`` in chunks equals the causal forward, the state
float32. Prints one line per case and exits 1 when any case fails.

Usage (repository root)::

    python3 plugins/attnkit-kernelized/benchmarks/check_half_gpu.py                  # CUDA
    TRITON_INTERPRET=1 python3 plugins/attnkit-kernelized/benchmarks/check_half_gpu.py --device cpu --length 40
"""

from __future__ import annotations

import argparse
import copy
import sys

CASES = [("linear", {}), ("linear", {"feature_map": "dpfp"}), ("performer", {"num_features": 64}),
         ("performer", {"num_features": 64, "feature_map": "generalized"}), ("rfa", {"num_features": 32}),
         ("fast-weight", {}), ("fast-weight", {"feature_map": "elu", "beta": 0.5})]
TOL = {"bfloat16": 2e-2, "float16": 5e-3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--length", type=int, default=300, help="L (not a multiple of the chunk)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--names", nargs="+", default=None, choices=sorted({n for n, _ in CASES}),
                   help="only these mechanisms (default: every case)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    args = p.parse_args(argv)

    import torch

    import attnkit
    from attnkit import masks

    dev, H, D, L = args.device, args.heads, args.head_dim, args.length
    failures = 0

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0

    for name, opts in CASES:
        if args.names and name not in args.names:
            continue
        caps = attnkit.get_spec(name).capabilities
        ref_fn = attnkit.get_spec(name).load_reference()
        for dt_name in args.dtypes:
            dt = getattr(torch, dt_name)
            for module_dtype in ("float32", dt_name):
                torch.manual_seed(0)
                base = attnkit.build(name, backend="triton", num_heads=H, head_dim=D, **opts).eval()
                attn = base.to(device=dev, dtype=getattr(torch, module_dtype))
                ref_attn = copy.deepcopy(attn).double()
                for causal in [c for c, ok in ((True, caps.causal), (False, caps.noncausal)) if ok]:
                    for padded in (False, True):
                        for std in ((1.0, 3.0, 12.0) if name == "performer" and causal and not padded else (1.0,)):
                            g = torch.Generator().manual_seed(1)
                            x = [(torch.randn(3, H, L, D, generator=g) * (std if i < 2 else 1.0)).to(dev, dt)
                                 for i in range(4)]
                            kpm = None
                            if padded:
                                kpm = torch.ones(3, L, dtype=torch.bool, device=dev)
                                kpm[0, -7:] = False
                                kpm[2] = False
                                pad = ~kpm[:, None, :, None]
                                x[1], x[2] = x[1].masked_fill(pad, float("nan")), x[2].masked_fill(pad, float("nan"))
                            q, k, v = (t.clone().requires_grad_() for t in x[:3])
                            rec: dict = {}
                            if name == "performer":
                                orig = attn._bounded_causal

                                def wrapped(*a, _orig=orig, _rec=rec, **kw):
                                    out = _orig(*a, **kw)
                                    _rec["path"] = "log-space torch" if out is None else f"bounded ({a[-1]})"
                                    return out
                                attn._bounded_causal = wrapped
                            label = (f"{name} {opts} {dt_name} module={module_dtype} causal={causal} "
                                     f"padded={padded} std={std}")
                            try:
                                out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
                                gq, gk, gv = torch.autograd.grad(out.float(), (q, k, v), grad_outputs=x[3].float())
                                ins = [t.detach().double().nan_to_num(0.0).requires_grad_() for t in (q, k, v)]
                                mask = masks.resolve(None, causal=causal, key_padding_mask=kpm)
                                want = ref_fn(ref_attn, *ins, mask=mask, positions=None)
                                gw = torch.autograd.grad(want, ins, grad_outputs=x[3].double())
                                errs = {"out": rel(out, want), "dq": rel(gq, gw[0]), "dk": rel(gk, gw[1]),
                                        "dv": rel(gv, gw[2])}
                                dtypes_ok = all(t.dtype == dt for t in (out, gq, gk, gv))
                                finite = all(bool(torch.isfinite(t).all()) for t in (out, gq, gk, gv))
                                zero_row = not padded or bool((out[2] == 0).all())
                                ok = dtypes_ok and finite and zero_row and max(errs.values()) <= TOL[dt_name]
                            except Exception as e:      # noqa: BLE001
                                ok, errs = False, {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                            finally:
                                if name == "performer":
                                    del attn._bounded_causal
                            failures += not ok
                            print(f"{'ok  ' if ok else 'FAIL'} {label} "
                                  + " ".join(f"{n}={e:.1e}" if isinstance(e, float) else f"{n}={e}"
                                             for n, e in errs.items())
                                  + (f" path={rec['path']}" if "path" in rec else ""), flush=True)
                # streaming in half: float32 state, step chunks equal the causal forward
                try:
                    g = torch.Generator().manual_seed(2)
                    q, k, v = (torch.randn(2, H, L, D, generator=g).to(dev, dt) for _ in range(3))
                    with torch.no_grad():
                        full = attn(q, k, v, causal=True)
                        st = attn.init_state(2, dtype=dt, device=dev)
                        outs = []
                        for s in range(0, L, 97):
                            o, st = attn.step(q[:, :, s:s + 97], k[:, :, s:s + 97], v[:, :, s:s + 97], st)
                            outs.append(o)
                    err = rel(torch.cat(outs, dim=2), full)
                    ok = err <= TOL[dt_name] and all(t.dtype == torch.float32 for t in st.data.values())
                except Exception as e:      # noqa: BLE001
                    ok, err = False, f"{type(e).__name__}: {str(e)[:300]}"
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {name} {opts} {dt_name} module={module_dtype} streaming "
                      f"step-vs-forward={err if isinstance(err, str) else f'{err:.1e}'}", flush=True)
    print(f"{failures} failing case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
