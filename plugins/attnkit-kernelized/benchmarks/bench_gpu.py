"""Check and time the kernelized plugin's triton kernels on one CUDA GPU, against SDPA and flash-linear-attention.

What it measures (B=1, causal, D=64):

1. Correctness (first, small: B=1, H=2, L=300, not a multiple of the chunk): ``linear``, ``performer``
   (256 features), ``rfa`` (causal gated form, 128 frequencies = 256 trig features, a random gate
   projection) and ``fast-weight`` (learned beta, DPFP features) built with ``backend="triton"``; the
   same state_dict loaded into a ``backend="torch"`` module cast to float64, run on the same inputs
   (the bfloat16 inputs upcast, so input rounding is not counted). Causal forward, then the gradients
   of ``sum(out * g)`` (fixed random ``g``) for q, k, v and every parameter. Errors: ``max_abs``,
   ``rel`` = max_abs / max|ref| (the pass criterion: float32 1e-4, bfloat16 2e-2) and ``max_rel_elem``
   = max |err| / (|ref| + 1e-3 max|ref|). When fla imports, its ``chunk_linear_attn`` and
   ``chunk_delta_rule`` are checked the same way, on the inputs of the timing rows below, against the
   float64 torch form of ours (and our kernels beside them).
2. Timing, H=8, per dtype and length: forward (under ``torch.no_grad``) and forward+backward
   (``torch.autograd.grad`` of ``sum(out * g)`` w.r.t. the inputs and parameters), the median of
   ``triton.testing.do_bench(warmup=25, rep=100)`` in ms (a call slower than ``--slow-call`` s is timed
   once instead), and the peak memory of one call (max_memory_allocated over what was allocated before).
   Methods: ``sdpa`` (``F.scaled_dot_product_attention(is_causal=True)``); the modules ``linear``,
   ``performer``, ``rfa``, ``fast-weight`` with ``backend="triton"``, ``linear-torch``,
   ``performer-torch``, ``rfa-torch`` and ``fast-weight-torch`` (the chunked torch forms on CUDA, up to
   ``--max-torch-len``); kernel level on
   identical, precomputed inputs (feature maps and layout copies outside the timed function):
   ``linear-kernel`` (our triton op) vs ``fla-linear`` (``chunk_linear_attn(normalize=True, scale=1)``),
   both on phi = elu(x) + 1 (our ``linear``'s default map; fla's op applies no feature map itself), and
   ``delta-kernel`` (our triton delta rule) vs ``fla-delta`` (``chunk_delta_rule(scale=1)``), both on
   l2-normalised q, k (M = D = 64) and beta = sigmoid(randn) in (0, 1), and ``gated-kernel`` (our triton
   gated rfa operator) vs ``fla-gated`` (``chunk_simple_gla(scale=1)``, head-wise scalar log decays; the
   numerator only, ours adds the normaliser), both on phi = elu(x) + 1 and log_g = logsigmoid(randn + 4).
   The module rows run in every
   ``--dtypes`` entry: the modules declare float16/bfloat16 (``capabilities.dtypes``) and are called as an
   autocast user would, float32 parameters with half inputs (features, states and normalisers in float32,
   the triton kernels reading half features and values with float32 accumulators; output and gradients in
   the input dtype). ``performer`` in bfloat16 runs the bounded-exponent path on the linear triton kernels
   while every key exponent lies within +-60 (float16 inputs: float32 features), else its log-space torch
   form (float32); every performer row records the path that ran. A module that does not declare a dtype
   has its rows in that dtype recorded as skipped (``module_dtypes``, ``skip_reason``).
   Once ``--budget`` seconds (counted from the start, correctness and compiles included) have passed,
   the remaining rows are recorded as skipped.

Every case runs in try/except (an error is recorded, never ends the run), and ``--out`` is rewritten after
every row, so a timeout keeps what was measured. At the end a markdown summary is printed.

Usage (repository root)::

    python3 plugins/attnkit-kernelized/benchmarks/bench_gpu.py --out bench_gpu.json
    TRITON_INTERPRET=1 python3 plugins/attnkit-kernelized/benchmarks/bench_gpu.py --smoke --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def _err(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {str(e)[:600]}{where}"


class Results:
    """The JSON document, rewritten whole after every change."""

    def __init__(self, path: str, info: dict) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"info": info, "notes": NOTES, "correctness": [], "cross_check": [],
                                    "timing": [], "finished": False}

    def add(self, section: str, row: dict) -> None:
        self.doc[section].append(row)
        self.save()

    def save(self) -> None:
        self.doc["info"]["elapsed_s"] = round(time.perf_counter() - T0, 2)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


NOTES = {
    "rel": "max_abs / max|reference| (pass: <= tol); max_rel_elem: max |err| / (|ref| + 1e-3 max|ref|)",
    "reference": "backend='torch' module with the same state_dict, cast to float64, on the same (upcast) inputs",
    "fla-linear": "chunk_linear_attn(phi_q, phi_k, v, scale=1.0, normalize=True) on phi = elu(x) + 1 computed "
                  "outside the timed function, [B, T, H, K] contiguous copies; compared with linear-kernel "
                  "(our triton op on the same phi, (B, H, L, M)). The module row 'linear' includes the map.",
    "fla-delta": "chunk_delta_rule(q, k, v, beta, scale=1.0) on l2-normalised q, k, beta = sigmoid(randn) "
                 "[B, T, H]; compared with delta-kernel (our triton delta rule on the same inputs, M = 64). "
                 "The module row 'fast-weight' uses DPFP features (M = 128), sum-normalised, learned beta.",
    "fla-gated": "chunk_simple_gla(phi_q, phi_k, v, g=log_g, scale=1.0) (head-wise scalar log decays, the "
                 "numerator only, no normaliser) on phi = elu(x) + 1, log_g = logsigmoid(randn + 4) float32 "
                 "[B, T, H]; compared with gated-kernel (our triton gated rfa operator on the same inputs, "
                 "numerator and normaliser, (B, H, L, M)). The module row 'rfa' includes its feature map and gates.",
    "fwd": "forward under torch.no_grad; fwdbwd: forward + torch.autograd.grad(sum(out * g)) w.r.t. inputs "
           "and parameters",
    "peak_mib": "torch.cuda.max_memory_allocated during one call minus memory_allocated before it",
    "performer_path": "'bounded (triton)' when the bounded-exponent path ran the linear kernels, 'log-space torch' "
                      "otherwise",
    "modules_half": "module rows in bfloat16/float16: float32 parameters, half inputs (autocast-like); output and "
                    "input gradients in the input dtype, parameter gradients float32",
}


# ------------------------------------------------------------------ modules
def module_options(name: str) -> dict:
    return {"performer": {"num_features": 256, "seed": 0}, "rfa": {"num_features": 128, "seed": 0}}.get(name, {})


def build(name: str, backend: str, heads: int, dim: int, device: str, seed: int = 0):
    import torch

    import attnkit

    torch.manual_seed(seed)
    mod = attnkit.build(name, backend=backend, num_heads=heads, head_dim=dim, **module_options(name))
    if name == "rfa" and getattr(mod, "gate", False):
        with torch.no_grad():     # the gate projection starts at zero: make it depend on k
            g = torch.Generator().manual_seed(seed + 1)
            mod.gate_weight.copy_(torch.randn(mod.gate_weight.shape, generator=g) * 0.3)
    mod.eval()
    return mod.to(device)


MODULE_METHODS = {"linear": "linear", "performer": "performer", "rfa": "rfa", "fast-weight": "fast-weight",
                  "linear-torch": "linear", "performer-torch": "performer", "rfa-torch": "rfa",
                  "fast-weight-torch": "fast-weight"}


@functools.cache
def module_dtypes(name: str) -> tuple[str, ...] | None:
    """The dtypes the module declares (``capabilities.dtypes``; None: unknown, try anyway)."""
    try:
        import attnkit

        mod = attnkit.build(name, num_heads=2, head_dim=8)
        return tuple(getattr(mod.capabilities, "dtypes", None) or ()) or None
    except Exception:      # noqa: BLE001
        return None


def track_performer(mod, record: dict) -> None:
    """Record which causal path a performer module ran (bounded: triton/linear kernels; else log space)."""
    if not hasattr(mod, "_bounded_causal"):
        return
    orig = mod._bounded_causal

    def wrapped(*a, **kw):
        out = orig(*a, **kw)
        record["performer_path"] = "log-space torch" if out is None else f"bounded ({a[-1]})"
        return out

    mod._bounded_causal = wrapped


# ------------------------------------------------------------------ correctness
def _compare(ours, ref, tol: float) -> dict:
    import torch

    if ours is None or ref is None:
        return {"max_abs": None, "rel": None, "ok": ours is None and ref is None, "note": "grad missing"}
    a, b = ours.detach().double(), ref.detach().double()
    scale = b.abs().max().item() if b.numel() else 0.0
    d = (a - b).abs()
    max_abs = d.max().item() if d.numel() else 0.0
    rel = max_abs / scale if scale > 0 else max_abs
    elem = (d / (b.abs() + 1e-3 * scale + 1e-30)).max().item() if d.numel() else 0.0
    finite = bool(torch.isfinite(a).all())
    return {"max_abs": max_abs, "ref_max": scale, "rel": rel, "max_rel_elem": elem, "finite": finite,
            "ok": finite and rel <= tol}


def correctness_case(name: str, dtype_name: str, args, device: str) -> dict:
    import torch

    dtype = getattr(torch, dtype_name)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    row: dict[str, Any] = {"method": name, "dtype": dtype_name, "tol": tol,
                           "shape": [1, args.check_heads, args.check_len, args.head_dim]}
    H, L, D = args.check_heads, args.check_len, args.head_dim
    tri = build(name, "triton", H, D, device)
    ref = build(name, "torch", H, D, device)
    ref.load_state_dict(tri.state_dict())
    ref = ref.double()
    track_performer(tri, row)
    g = torch.Generator().manual_seed(1234)
    base = [torch.randn(1, H, L, D, generator=g) for _ in range(4)]
    x = [t.to(device=device, dtype=dtype) for t in base]
    q, k, v = (t.clone().requires_grad_() for t in x[:3])
    go = x[3]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    out = tri(q, k, v, causal=True)
    params = [p for p in tri.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [q, k, v, *params], grad_outputs=go, allow_unused=True)
    if device == "cuda":
        torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    out_r = ref(qr, kr, vr, causal=True)
    params_r = [p for p in ref.parameters() if p.requires_grad]
    grads_r = torch.autograd.grad(out_r, [qr, kr, vr, *params_r], grad_outputs=go.double(), allow_unused=True)
    names = ["out", "dq", "dk", "dv"] + ["d_" + n for n, p in tri.named_parameters() if p.requires_grad]
    row["errors"] = {n: _compare(a, b, tol) for n, a, b in zip(names, [out, *grads], [out_r, *grads_r])}
    row["ok"] = all(e["ok"] for e in row["errors"].values())
    return row


# ------------------------------------------------------------------ inputs and methods
def make_inputs(B: int, H: int, L: int, D: int, dtype, device: str, seed: int = 0) -> dict:
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(seed + L)
    q, k, v, go = (torch.randn(B, H, L, D, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    beta = torch.sigmoid(torch.randn(B, H, L, generator=g)).to(device=device, dtype=dtype)
    log_g = F.logsigmoid(torch.randn(B, H, L, generator=g) + 4).to(device=device)   # float32 log decays near 1
    with torch.no_grad():
        phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
        qn, kn = F.normalize(q.float(), dim=-1).to(dtype), F.normalize(k.float(), dim=-1).to(dtype)
    return {"q": q, "k": k, "v": v, "go": go, "beta": beta, "phi_q": phi_q, "phi_k": phi_k, "qn": qn, "kn": kn,
            "log_g": log_g}


def bhld_to_bthk(x):
    return x.transpose(1, 2).contiguous()


def method_specs(args, device: str, fla: Any) -> dict[str, Callable]:
    """name -> factory(inputs, record) -> (fn() -> out, leaves requiring grad, grad_out)."""
    import torch.nn.functional as F

    H, D = args.heads, args.head_dim
    causal = not args.not_causal    # the module rows and sdpa; the kernel rows are causal

    def module_method(name: str, backend: str) -> Callable:
        def factory(inp, rec):
            mod = build(name, backend, H, D, device)
            if name == "performer":
                track_performer(mod, rec)
            q, k, v = (inp[n].detach().clone().requires_grad_() for n in "qkv")
            params = [p for p in mod.parameters() if p.requires_grad]
            return (lambda: mod(q, k, v, causal=causal)), [q, k, v, *params], inp["go"]
        return factory

    def sdpa(inp, rec):
        q, k, v = (inp[n].detach().clone().requires_grad_() for n in "qkv")
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), [q, k, v], inp["go"]

    def linear_kernel(inp, rec):
        from attnkit_kernelized.linear import triton_ops

        pq, pk, v = (inp[n].detach().clone().requires_grad_() for n in ("phi_q", "phi_k", "v"))
        return (lambda: triton_ops.linear_attention(pq, pk, v, causal=True)[0]), [pq, pk, v], inp["go"]

    def fla_linear(inp, rec):
        pq, pk, v = (bhld_to_bthk(inp[n]).requires_grad_() for n in ("phi_q", "phi_k", "v"))
        fn = fla.ops.linear_attn.chunk_linear_attn
        return (lambda: fn(pq, pk, v, scale=1.0, normalize=True)[0]), [pq, pk, v], bhld_to_bthk(inp["go"])

    def delta_kernel(inp, rec):
        from attnkit_kernelized.fast_weight import triton_ops

        qn, kn, v, b = (inp[n].detach().clone().requires_grad_() for n in ("qn", "kn", "v", "beta"))
        return (lambda: triton_ops.delta_rule(qn, kn, v, b)[0]), [qn, kn, v, b], inp["go"]

    def fla_delta(inp, rec):
        qn, kn, v = (bhld_to_bthk(inp[n]).requires_grad_() for n in ("qn", "kn", "v"))
        b = inp["beta"].transpose(1, 2).contiguous().requires_grad_()
        fn = fla.ops.delta_rule.chunk_delta_rule

        def run():
            return fn(qn, kn, v, b, scale=1.0, initial_state=None, output_final_state=False)[0]
        return run, [qn, kn, v, b], bhld_to_bthk(inp["go"])

    def gated_kernel(inp, rec):
        from attnkit_kernelized.rfa import triton_ops

        pq, pk, v, lg = (inp[n].detach().clone().requires_grad_() for n in ("phi_q", "phi_k", "v", "log_g"))
        return (lambda: triton_ops.gated_attention(pq, pk, v, lg)[0]), [pq, pk, v, lg], inp["go"]

    def fla_gated(inp, rec):
        pq, pk, v = (bhld_to_bthk(inp[n]).requires_grad_() for n in ("phi_q", "phi_k", "v"))
        lg = inp["log_g"].transpose(1, 2).contiguous().requires_grad_()
        fn = fla.ops.simple_gla.chunk_simple_gla
        return (lambda: fn(pq, pk, v, g=lg, scale=1.0)[0]), [pq, pk, v, lg], bhld_to_bthk(inp["go"])

    specs: dict[str, Callable] = {"sdpa": sdpa}
    for name in ("linear", "performer", "rfa", "fast-weight"):
        specs[name] = module_method(name, "triton")
    for name in ("linear", "performer", "rfa"):
        specs[f"{name}-torch"] = module_method(name, "torch")
    specs["fast-weight-torch"] = module_method("fast-weight", "torch")
    specs["linear-kernel"] = linear_kernel
    specs["fla-linear"] = fla_linear
    specs["delta-kernel"] = delta_kernel
    specs["fla-delta"] = fla_delta
    specs["gated-kernel"] = gated_kernel
    specs["fla-gated"] = fla_gated
    return specs


def skip_reason(method: str, L: int, dtype_name: str, args, fla: Any) -> str | None:
    if method in MODULE_METHODS:
        dts = module_dtypes(MODULE_METHODS[method])
        if dts is not None and dtype_name not in dts:
            return f"the {MODULE_METHODS[method]!r} module declares dtypes {list(dts)} and refuses {dtype_name} inputs"
    if method.startswith("fla") and fla is None:
        return "fla not importable"
    if method.endswith("-torch") and L > args.max_torch_len:
        return (f"chunked torch path above --max-torch-len={args.max_torch_len}: sequential per-chunk "
                "torch ops (time), autograd keeps every chunk's intermediates")
    if method == "sdpa" and L > args.max_sdpa_len:
        return f"L > --max-sdpa-len={args.max_sdpa_len} (L^2 time)"
    if method == "fla-delta" and dtype_name == "float32":
        return "fla 0.6.0 chunk_delta_rule asserts q.dtype != float32"
    return None


# ------------------------------------------------------------------ timing
def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable, device: str, args) -> tuple[float, str]:
    """(ms, how): one call first (compile and warm-up), a second timed; do_bench unless that one is slow."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    once = time.perf_counter() - t0
    if device != "cuda" or once > args.slow_call:
        return once * 1e3, "single call"
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")), "do_bench median"


def peak_mib(fn: Callable, device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def timing_row(method: str, factory: Callable, inp: dict, args, device: str, rec: dict) -> None:
    import torch

    fn, leaves, go = factory(inp, rec)

    def fwd():
        with torch.no_grad():
            return fn()

    def fwdbwd():
        out = fn()
        return torch.autograd.grad(out, leaves, grad_outputs=go, allow_unused=True)

    for mode, f in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        try:
            ms, how = time_ms(f, device, args)
            rec[f"{mode}_ms"] = ms
            rec[f"{mode}_how"] = how
            rec[f"{mode}_peak_mib"] = peak_mib(f, device)
        except Exception as e:      # noqa: BLE001 - recorded, the run goes on
            rec[f"{mode}_error"] = _err(e)


# ------------------------------------------------------------------ cross-check of fla
def cross_check(res: Results, args, device: str, fla: Any, dtype_name: str) -> None:
    """fla's ops and our kernels, on identical inputs, against the float64 torch form of ours."""
    import torch

    from attnkit_kernelized.fast_weight import chunk as fw_chunk
    from attnkit_kernelized.fast_weight import triton_ops as fw_tri
    from attnkit_kernelized.linear import chunk as lin_chunk
    from attnkit_kernelized.linear import triton_ops as lin_tri

    dtype = getattr(torch, dtype_name)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    inp = make_inputs(1, args.check_heads, args.check_len, args.head_dim, dtype, device, seed=7)
    d64 = {n: t.double() for n, t in inp.items()}
    refs = {
        "linear": lin_chunk.linear_attention(d64["phi_q"], d64["phi_k"], d64["v"], causal=True)[0],
        "delta": fw_chunk.delta_rule(d64["qn"], d64["kn"], d64["v"], d64["beta"])[0],
    }
    cases: list[tuple[str, str, Callable]] = [
        ("linear-kernel", "linear", lambda: lin_tri.linear_attention(inp["phi_q"], inp["phi_k"], inp["v"],
                                                                     causal=True)[0]),
        ("delta-kernel", "delta", lambda: fw_tri.delta_rule(inp["qn"], inp["kn"], inp["v"], inp["beta"])[0]),
    ]
    if fla is not None:
        t = {n: bhld_to_bthk(inp[n]) for n in ("phi_q", "phi_k", "qn", "kn", "v")}
        beta_t = inp["beta"].transpose(1, 2).contiguous()
        cases.append(("fla-linear", "linear", lambda: fla.ops.linear_attn.chunk_linear_attn(
            t["phi_q"], t["phi_k"], t["v"], scale=1.0, normalize=True)[0].transpose(1, 2)))
        cases.append(("fla-delta", "delta", lambda: fla.ops.delta_rule.chunk_delta_rule(
            t["qn"], t["kn"], t["v"], beta_t, scale=1.0, initial_state=None,
            output_final_state=False)[0].transpose(1, 2)))
    for name, ref_key, fn in cases:
        row: dict[str, Any] = {"method": name, "dtype": dtype_name, "tol": tol, "what": "forward output only"}
        try:
            with torch.no_grad():
                row["errors"] = {"out": _compare(fn(), refs[ref_key], tol)}
            row["ok"] = row["errors"]["out"]["ok"]
        except Exception as e:      # noqa: BLE001
            row["error"] = _err(e)
            row["ok"] = False
        res.add("cross_check", row)
        log(f"cross-check {name:14s} {dtype_name:9s} "
            + (f"rel={row['errors']['out']['rel']:.2e} ok={row['ok']}" if "errors" in row else row["error"]))


# ------------------------------------------------------------------ report
PAIRS = [("sdpa", "linear"), ("sdpa", "performer"), ("sdpa", "rfa"), ("sdpa", "fast-weight"),
         ("linear-torch", "linear"), ("performer-torch", "performer"), ("rfa-torch", "rfa"),
         ("fast-weight-torch", "fast-weight"),
         ("fla-linear", "linear-kernel"), ("fla-delta", "delta-kernel"), ("fla-gated", "gated-kernel")]


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(doc: dict) -> str:
    lines = []
    rows = doc["timing"]
    for dtype_name in dict.fromkeys(r["dtype"] for r in rows):
        sel = [r for r in rows if r["dtype"] == dtype_name]
        methods = list(dict.fromkeys(r["method"] for r in sel))
        lengths = sorted({r["L"] for r in sel})
        lines.append(f"\n### {dtype_name}: ms forward / forward+backward (skipped: -, error: ERR)\n")
        lines.append("| method | " + " | ".join(f"L={L}" for L in lengths) + " |")
        lines.append("|---|" + "---:|" * len(lengths))
        by = {(r["method"], r["L"]): r for r in sel}
        for m in methods:
            cells = []
            for L in lengths:
                r = by.get((m, L))
                if r is None or "skipped" in r:
                    cells.append("-")
                    continue
                parts = []
                for mode in ("fwd", "fwdbwd"):
                    parts.append("ERR" if f"{mode}_error" in r else _fmt(r.get(f"{mode}_ms")))
                cells.append(" / ".join(parts))
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append(f"\n{dtype_name}: ratios base/ours (>1: ours faster), fwd / fwd+bwd\n")
        lines.append("| base / ours | " + " | ".join(f"L={L}" for L in lengths) + " |")
        lines.append("|---|" + "---:|" * len(lengths))
        for base, ours in PAIRS:
            cells, any_val = [], False
            for L in lengths:
                a, b = by.get((base, L), {}), by.get((ours, L), {})
                parts = []
                for mode in ("fwd", "fwdbwd"):
                    x, y = a.get(f"{mode}_ms"), b.get(f"{mode}_ms")
                    parts.append(_fmt(x / y, ".2f") if x and y else "–")
                    any_val = any_val or bool(x and y)
                cells.append(" / ".join(parts))
            if any_val:
                lines.append(f"| {base} / {ours} | " + " | ".join(cells) + " |")
    lines.append("\n### correctness (triton vs float64 torch path; rel = max_abs / max|ref|)\n")
    lines.append("| method | dtype | ok | worst | rel out | rel dq | rel dk | rel dv | params (worst rel) |")
    lines.append("|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in doc["correctness"] + doc["cross_check"]:
        if "skipped" in r:
            lines.append(f"| {r['method']} | {r['dtype']} | skipped | {r['skipped'][:80]} | | | | | |")
            continue
        if "errors" not in r:
            lines.append(f"| {r['method']} | {r['dtype']} | ERROR | {r.get('error', '')[:80]} | | | | | |")
            continue
        e = r["errors"]
        rel = {n: x.get("rel") for n, x in e.items()}
        worst = max(rel, key=lambda n: -1 if rel[n] is None else rel[n])
        prm = [x for n, x in rel.items() if n.startswith("d_") and x is not None]
        cells = [_fmt(rel.get(n), ".1e") for n in ("out", "dq", "dk", "dv")] + [_fmt(max(prm) if prm else None, ".1e")]
        lines.append(f"| {r['method']} | {r['dtype']} | {r['ok']} | {worst} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_gpu.json", help="JSON results, rewritten after every row")
    p.add_argument("--smoke", action="store_true",
                   help="CPU tensors under TRITON_INTERPRET=1, tiny shapes: only proves the code paths run")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="default 1024 4096 16384 65536")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--budget", type=float, default=150.0,
                   help="seconds from the start after which the remaining timing rows are skipped")
    p.add_argument("--methods", nargs="+", default=None, help="time only these methods")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--check-len", type=int, default=300, help="correctness length (not a multiple of the chunk)")
    p.add_argument("--check-heads", type=int, default=2)
    p.add_argument("--max-torch-len", type=int, default=16384, help="longest L of the *-torch rows")
    p.add_argument("--max-sdpa-len", type=int, default=65536, help="longest L of the sdpa rows")
    p.add_argument("--slow-call", type=float, default=1.0,
                   help="a second call slower than this (s) is reported as that single call, no do_bench")
    p.add_argument("--no-check", action="store_true", help="skip the correctness section")
    p.add_argument("--segment-length", type=int, default=None,
                   help="positions per causal segment of the modules that segment (rfa, performer, fast-weight; "
                        "default: the class's, 2,048); linear runs one segment whatever this says")
    p.add_argument("--not-causal", action="store_true",
                   help="time the module rows and sdpa without the causal mask (the kernel rows stay causal)")
    p.add_argument("--check-methods", nargs="+", default=["linear", "performer", "rfa", "fast-weight"],
                   help="modules the correctness section checks")
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (kernels read it)
        args.lengths = args.lengths or [64, 128]
        args.heads = 2
        args.check_len = 70
    args.lengths = args.lengths or [1024, 4096, 16384, 65536]

    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available (use --smoke for the CPU interpreter check)", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--smoke needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import triton

    import attnkit_kernelized

    info: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "argv": vars(args),
        "device": device, "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "attnkit_kernelized": getattr(attnkit_kernelized, "__version__", None),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "module_rows_causal": not args.not_causal,
        "segment_length": args.segment_length,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        torch.backends.cuda.matmul.allow_tf32 = False
    fla = None
    try:
        import fla as fla_mod
        import fla.ops.delta_rule
        import fla.ops.linear_attn
        import fla.ops.simple_gla  # noqa: F401

        fla = fla_mod
        info["fla"] = getattr(fla_mod, "__version__", "unknown")
    except Exception as e:      # noqa: BLE001
        info["fla"] = None
        info["fla_import_error"] = _err(e)
    if args.segment_length is not None:
        from attnkit_kernelized.base import KernelizedAttention

        KernelizedAttention.segment_length = args.segment_length
    res = Results(args.out, info)
    res.save()
    log(f"device={info.get('gpu', device)} torch={torch.__version__} triton={triton.__version__} "
        f"fla={info['fla'] or 'not importable: ' + info['fla_import_error'][:120]}")

    # ---- correctness
    if not args.no_check:
        for dtype_name in args.dtypes:
            for name in args.check_methods:
                dts = module_dtypes(name)
                if dts is not None and dtype_name not in dts:
                    res.add("correctness", {"method": name, "dtype": dtype_name, "ok": None,
                                            "skipped": f"module declares dtypes {list(dts)}"})
                    log(f"check {name:12s} {dtype_name:9s} skipped: module declares dtypes {list(dts)}")
                    continue
                try:
                    row = correctness_case(name, dtype_name, args, device)
                except Exception as e:      # noqa: BLE001
                    row = {"method": name, "dtype": dtype_name, "ok": False, "error": _err(e)}
                res.add("correctness", row)
                if "errors" in row:
                    worst = max(row["errors"].items(), key=lambda kv: kv[1]["rel"] or 0)
                    log(f"check {name:12s} {dtype_name:9s} ok={row['ok']} worst {worst[0]} rel={worst[1]['rel']:.2e}"
                        + (f" path={row['performer_path']}" if "performer_path" in row else ""))
                else:
                    log(f"check {name:12s} {dtype_name:9s} ERROR {row['error'][:200]}")
            try:
                cross_check(res, args, device, fla, dtype_name)
            except Exception as e:      # noqa: BLE001
                res.add("cross_check", {"method": "setup", "dtype": dtype_name, "ok": False, "error": _err(e)})
                log(f"cross-check {dtype_name} ERROR {_err(e)[:200]}")

    # ---- timing
    specs = method_specs(args, device, fla)
    order = [m for m in specs if args.methods is None or m in args.methods]
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for L in args.lengths:
            inp = None
            for method in order:
                rec: dict[str, Any] = {"method": method, "dtype": dtype_name, "L": L, "B": 1, "H": args.heads,
                                       "D": args.head_dim}
                reason = skip_reason(method, L, dtype_name, args, fla)
                if reason is None and time.perf_counter() - T0 > args.budget:
                    reason = f"budget of {args.budget:.0f} s exceeded"
                if reason is not None:
                    rec["skipped"] = reason
                    res.add("timing", rec)
                    continue
                t0 = time.perf_counter()
                try:
                    if inp is None:
                        inp = make_inputs(1, args.heads, L, args.head_dim, dtype, device)
                    timing_row(method, specs[method], inp, args, device, rec)
                except Exception as e:      # noqa: BLE001
                    rec["error"] = _err(e)
                rec["wall_s"] = round(time.perf_counter() - t0, 2)
                res.add("timing", rec)
                msg = " ".join(f"{m}={rec[m + '_ms']:.3f}ms" if m + "_ms" in rec else f"{m}=ERR"
                               for m in ("fwd", "fwdbwd"))
                err = rec.get("error") or rec.get("fwd_error") or rec.get("fwdbwd_error")
                log(f"time {method:17s} {dtype_name:9s} L={L:6d} {msg} ({rec['wall_s']:.1f}s)"
                    + (f" path={rec['performer_path']}" if "performer_path" in rec else "")
                    + (f" ERROR {err[:160]}" if err else ""))
                if device == "cuda":
                    torch.cuda.empty_cache()
            del inp
    res.doc["finished"] = True
    res.save()
    print(markdown(res.doc), flush=True)
    n_bad = sum(r.get("ok") is False for r in res.doc["correctness"] + res.doc["cross_check"])
    log(f"wrote {args.out}; correctness cases failing or erroring: {n_bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
