"""The block-sparse engine on a CUDA GPU: agreement with the reference, then timings against SDPA and FlexAttention.

Three sections, every row in its own ``try`` (a failure is recorded with its
message and the run goes on); the JSON file is rewritten after every row, so
a run stopped at its time limit keeps what it measured.

1. ``check``: the ``triton``, ``flex`` and ``torch`` backends on CUDA tensors
   against the float64 dense reference (:func:`reference_attend`), outputs and
   gradients of q, k, v, for a few masks (causal window, BigBird's pattern,
   key padding with a poisoned padded key), in float32 and bfloat16.
2. ``engine``: issue 10's table in bfloat16, B=1, H=8, D=64, forward and
   forward+backward: causal ``local`` with a 256-key window against SDPA
   causal (flash) and PyTorch's FlexAttention with its own
   ``create_block_mask`` (compiled), and the engine's ``flex`` and ``triton``
   backends; ``bigbird`` and ``longformer`` (their modules' defaults, the
   papers' settings) against SDPA. Block-index build times (the engine's
   ``plan``, FlexAttention's ``create_block_mask``) and the peak memory of
   each call are reported apart.
3. ``mechanisms``: every mechanism named in ``--mechanisms`` built with
   ``attnkit.build`` (whatever plugins are installed) and moved to the device
   and ``--mech-dtype`` with ``module.to(device, dtype)`` (the module path a
   user takes, not an engine call), at ``--mech-lengths``, forward and
   forward+backward against SDPA in the same dtype. ``--mech-dtype``:
   bfloat16 on CUDA unless given (every sparse module takes float16 and
   bfloat16; a module that does not is recorded with its refusal), float32
   under ``--smoke`` unless given (``--smoke --mech-dtype bfloat16`` runs the
   half module path on CPU).

Times are ``triton.testing.do_bench`` medians (CUDA events, L2 flushed
between calls) in milliseconds. ``--smoke`` runs every path once on tiny CPU
shapes (set ``TRITON_INTERPRET=1``) to prove the script runs; its figures
mean nothing.

    python plugins/attnkit-sparse/benchmarks/bench_gpu.py --out bench_gpu_sparse.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks
from attnkit_sparse.engine import attend, plan, reference_attend

B, H, D = 1, 8, 64
WINDOW = 256
#: --smoke: eager FlexAttention (no compile on CPU)
SMOKE = False
DEFAULT_MECHANISMS = ["lsh", "routing", "sinkhorn", "nystrom", "linformer", "soft", "informer", "clustered",
                      "adaptive-span", "local", "bigbird", "longformer", "dilated", "strided", "axial"]


class Run:
    """The results so far, rewritten to ``path`` after every row; progress lines flushed to stdout."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path, self.data, self.t0 = path, {"meta": meta, "check": [], "engine": [], "mechanisms": []}, time.time()

    def add(self, section: str, row: dict[str, Any]) -> None:
        row["elapsed_s"] = round(time.time() - self.t0, 1)
        self.data[section].append(row)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        short = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items() if k != "trace"}
        print(section, json.dumps(short, default=str), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds of ``fn``: do_bench on CUDA, a few wall-clock calls on CPU (smoke only)."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    ts = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def leaves(L: int, dtype: torch.dtype, device: torch.device, seed: int, grad: bool) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
            for _ in range(3)]


def fwd_bwd(fn: Callable[..., torch.Tensor], xs: list[torch.Tensor]) -> Callable[[], Any]:
    grad_out = torch.randn_like(xs[0])

    def run() -> Any:
        out = fn(*xs)
        return torch.autograd.grad(out, xs, grad_out, allow_unused=True)   # shared-QK leaves k unused
    return run


def measure(fn: Callable[..., torch.Tensor], L: int, dtype: torch.dtype, device: torch.device,
            modes: tuple[str, ...] = ("fwd", "fwdbwd")) -> dict[str, Any]:
    """ms and peak bytes of ``fn(q, k, v)`` forward (no grad) and forward+backward."""
    row: dict[str, Any] = {}
    if "fwd" in modes:
        xs = leaves(L, dtype, device, L, False)
        with torch.no_grad():
            call = (lambda: fn(*xs))
            t0 = time.perf_counter()
            call()
            sync(device)
            row["first_call_s"] = time.perf_counter() - t0
            row["fwd_ms"] = timed_ms(call, device)
            row["fwd_peak_bytes"] = peak_bytes(call, device)
        del xs
    if "fwdbwd" in modes:
        try:
            xs = leaves(L, dtype, device, L, True)
            call = fwd_bwd(fn, xs)
            call()
            sync(device)
            row["fwdbwd_ms"] = timed_ms(call, device)
            row["fwdbwd_peak_bytes"] = peak_bytes(call, device)
            del xs
        except Exception as exc:  # noqa: BLE001 - the forward's figures stand
            row["fwdbwd_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------------- check
def check_masks(L: int, device: torch.device) -> dict[str, Any]:
    bigbird = attnkit.build("bigbird", num_heads=H, head_dim=D, block_size=16, num_random=2, num_global=1,
                            num_window=3)
    kpm = torch.ones(B, L, dtype=torch.bool)
    kpm[:, L - 7:] = False
    return {
        "causal_window20": (masks.causal() & masks.sliding_window(20), None),
        "bigbird_b16": (bigbird.pattern_mask(L, L), None),
        "key_padding_window": (masks.key_padding(kpm.to(device)) & masks.sliding_window(8, 8), kpm),
    }


def check(run: Run, device: torch.device, L: int, backends: list[str]) -> None:
    for mask_name, (mask, kpm) in check_masks(L, device).items():
        for dtype in (torch.float32, torch.bfloat16):
            ref_in = leaves(L, torch.float64, device, 11, True)
            if kpm is not None:  # poison the padded keys of the backends' inputs, not the reference's
                pad = ~kpm.to(device)[:, None, :, None]
                ref_in = [t.detach().masked_fill(pad, 0.0).requires_grad_() for t in ref_in]
            ref = reference_attend(*ref_in, mask)
            grad_out = torch.randn_like(ref)
            ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
            for backend in backends:
                if backend == "flex" and (dtype != torch.bfloat16 or mask_name == "bigbird_b16"):
                    continue  # a FlexAttention compile per mask and dtype: two cases are enough
                row: dict[str, Any] = {"mask": mask_name, "dtype": str(dtype).split(".")[-1], "backend": backend,
                                       "L": L}
                try:
                    xs = [t.detach().to(dtype) for t in ref_in]
                    if kpm is not None:
                        xs[1] = xs[1].masked_fill(pad, float("nan"))
                        xs[2] = xs[2].masked_fill(pad, 1e4)
                    xs = [t.requires_grad_() for t in xs]
                    out = attend(*xs, mask, backend=backend, block_size=16 if backend != "flex" else None)
                    grads = torch.autograd.grad(out, xs, grad_out.to(dtype))
                    scale = max(1.0, float(ref.abs().max()))
                    row["out_err"] = float((out.double() - ref).abs().max()) / scale
                    for name, a, b in zip("qkv", grads, ref_grads):
                        row[f"d{name}_err"] = float((a.double() - b).abs().max()) / max(1.0, float(b.abs().max()))
                    tol = 1e-4 if dtype == torch.float32 else 3e-2
                    errs = [row[k] for k in ("out_err", "dq_err", "dk_err", "dv_err")]
                    row["ok"] = all(math.isfinite(e) and e <= tol for e in errs)
                    row["tol"] = tol
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500],
                               trace=traceback.format_exc()[-1500:])
                run.add("check", row)


# --------------------------------------------------------------------------------------------------- engine
def flex_local(L: int, device: torch.device) -> tuple[Callable[..., torch.Tensor], float]:
    """FlexAttention as a user writes it for the causal 256-key window: its block mask and compiled kernel."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)

    t0 = time.perf_counter()
    bm = create_block_mask(mask_mod, None, None, L, L, device=str(device))
    sync(device)
    build_s = time.perf_counter() - t0
    compiled = flex_attention if SMOKE else torch.compile(flex_attention, dynamic=False)
    return (lambda q, k, v: compiled(q, k, v, block_mask=bm)), build_s


def engine(run: Run, device: torch.device, lengths: list[int], dtype: torch.dtype, budget: float,
           block_sizes: list[int], pattern_flex_lengths: list[int], flex_block_sizes: list[int],
           only: list[str] | None) -> None:
    local_mask = masks.causal() & masks.sliding_window(WINDOW - 1)   # 256 keys, itself included
    patterns = {"bigbird": attnkit.build("bigbird", num_heads=H, head_dim=D),
                "longformer": attnkit.build("longformer", num_heads=H, head_dim=D)}
    cases: list[tuple[int, str, str, Callable[[], tuple[Callable[..., torch.Tensor], dict[str, Any]]]]] = []
    for L in lengths:  # the local window first at every length (issue 10's headline), then the papers' patterns
        cases.append((L, "local", "sdpa", lambda: (lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                                                  is_causal=True), {})))

        def flex_raw(L=L):
            fn, build_s = flex_local(L, device)
            return fn, {"block_mask_s": build_s}
        cases.append((L, "local", "flexattention", flex_raw))
        for backend in ("flex", "triton"):
            for bs in (block_sizes if backend == "triton" else flex_block_sizes):
                def ours(backend=backend, bs=bs, L=L, mask=local_mask):
                    t0 = time.perf_counter()
                    plan(mask, B, H, L, L, block_size=bs, device=device)
                    sync(device)
                    extra = {"plan_s": time.perf_counter() - t0, "block_size": bs}
                    return (lambda q, k, v: attend(q, k, v, mask, backend=backend, block_size=bs)), extra
                cases.append((L, "local", f"{backend}-b{bs}", ours))
    for L in lengths:
        for pname, mod in patterns.items():
            cases.append((L, pname, "sdpa", lambda: (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), {})))
            # FlexAttention compiles per length and mask (tens of seconds): at pattern_flex_lengths only
            for backend in (("flex", "triton") if L in pattern_flex_lengths else ("triton",)):
                def pat(backend=backend, L=L, mod=mod):
                    mask = mod.pattern_mask(L, L)
                    bs = 128 if backend == "flex" else 64
                    t0 = time.perf_counter()
                    p = plan(mask, B, H, L, L, block_size=bs, device=device)
                    sync(device)
                    extra = {"plan_s": time.perf_counter() - t0, "block_size": bs,
                             "tile_density": float(p.kv_count.double().sum() / (p.kv_count.numel()
                                                                                 * p.num_blocks[1]))}
                    return (lambda q, k, v: attend(q, k, v, mask, backend=backend, block_size=bs)), extra
                cases.append((L, pname, backend, pat))
    for L, pattern, name, make in cases:
        if only is not None and name not in only:
            continue
        row: dict[str, Any] = {"pattern": pattern, "method": name, "L": L, "dtype": str(dtype).split(".")[-1]}
        if time.time() - run.t0 > budget:
            row["skipped"] = "time budget spent"
            run.add("engine", row)
            continue
        try:
            fn, extra = make()
            row.update(extra)
            row.update(measure(fn, L, dtype, device))
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            row["trace"] = traceback.format_exc()[-1500:]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        run.add("engine", row)


# ----------------------------------------------------------------------------------------------- mechanisms
def mechanisms(run: Run, device: torch.device, names: list[str], lengths: list[int], dtype: torch.dtype,
               budget: float, backends: tuple[str, ...] = ("auto",)) -> None:
    """Each mechanism once per backend in ``backends`` (``auto``: the module's own choice, recorded); a backend
    the mechanism does not offer is recorded as skipped."""
    for L in lengths:
        rows = [("sdpa", "auto")] + [(n, b) for n in names for b in backends]
        for name, backend in rows:
            label = name if backend == "auto" else f"{name}@{backend}"
            row: dict[str, Any] = {"mechanism": label, "L": L, "dtype": str(dtype).split(".")[-1]}
            if time.time() - run.t0 > budget:
                row["skipped"] = "time budget spent"
                run.add("mechanisms", row)
                continue
            try:
                if name != "sdpa" and backend != "auto":
                    offered = attnkit.get_spec(name).capabilities.backends
                    if backend not in offered:
                        row["skipped"] = f"{name!r} offers backends {list(offered)}"
                        run.add("mechanisms", row)
                        continue
                if name == "sdpa":
                    fn = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
                else:
                    torch.manual_seed(0)
                    opts: dict[str, Any] = {"num_heads": H, "head_dim": D}
                    if backend != "auto":
                        opts["backend"] = backend
                    if name == "linformer":
                        opts.update(proj_len=256, max_length=L)
                    if name == "axial":
                        side = int(math.isqrt(L))
                        opts["grid"] = (side, L // side)
                    mod = attnkit.build(name, **opts).to(device=device, dtype=dtype).eval()   # the module path
                    caps = getattr(mod, "caps", None)
                    row["declares_dtype"] = str(dtype).split(".")[-1] in getattr(caps, "dtypes", ())
                    probe = torch.empty(B, H, L, D, device=device, dtype=dtype)
                    row["backend"] = mod.resolve_backend(probe, needs_grad=False)
                    shared_qk = getattr(caps, "shared_qk", False)
                    row["shared_qk"] = bool(shared_qk)
                    fn = ((lambda q, k, v, mod=mod: mod(q, q, v)) if shared_qk
                          else (lambda q, k, v, mod=mod: mod(q, k, v)))
                row.update(measure(fn, L, dtype, device))
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            run.add("mechanisms", row)


# ---------------------------------------------------------------------------------------------------- tables
def _ratio(sdpa: dict[str, Any], row: dict[str, Any], key: str) -> str:
    return f"{sdpa[key] / row[key]:.2f}x" if key in sdpa and key in row else ""


def tables(data: dict[str, Any]) -> str:
    lines = ["## check (max error / max(1, |ref|max))", "| mask | dtype | backend | out | dq | dk | dv | ok |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in data["check"]:
        if "error" in r:
            lines.append(f"| {r['mask']} | {r['dtype']} | {r['backend']} | error: {r['error'][:80]} |||||")
            continue
        lines.append(f"| {r['mask']} | {r['dtype']} | {r['backend']} | " + " | ".join(
            f"{r[k]:.1e}" for k in ("out_err", "dq_err", "dk_err", "dv_err")) + f" | {r['ok']} |")
    lines += ["", "## engine (ms, median)", "| pattern | method | L | fwd | fwd+bwd | sdpa/ours fwd | sdpa/ours f+b |"
              " peak fwd MiB | build s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    sdpa = {(r["pattern"], r["L"]): r for r in data["engine"] if r["method"] == "sdpa" and "fwd_ms" in r}
    for r in data["engine"]:
        if "fwd_ms" not in r:
            lines.append(f"| {r['pattern']} | {r['method']} | {r['L']} | {r.get('error', r.get('skipped', ''))[:90]} "
                         "||||||")
            continue
        s = sdpa.get((r["pattern"], r["L"]), {})
        build = r.get("plan_s", r.get("block_mask_s"))
        peak = r.get("fwd_peak_bytes")
        mib = "" if peak is None else f"{peak / 2**20:.0f}"
        lines.append(f"| {r['pattern']} | {r['method']} | {r['L']} | {r['fwd_ms']:.3f} | "
                     f"{r.get('fwdbwd_ms', math.nan):.3f} | {_ratio(s, r, 'fwd_ms')} | {_ratio(s, r, 'fwdbwd_ms')} | "
                     f"{mib} | {'' if build is None else f'{build:.3f}'} |")
    lines += ["", "## mechanisms (ms, median)",
              "| mechanism | backend | L | fwd | fwd+bwd | sdpa/ours fwd | sdpa/ours f+b |",
              "|---|---|---:|---:|---:|---:|---:|"]
    sd = {r["L"]: r for r in data["mechanisms"] if r["mechanism"] == "sdpa" and "fwd_ms" in r}
    for r in data["mechanisms"]:
        if "fwd_ms" not in r:
            lines.append(f"| {r['mechanism']} | | {r['L']} | {r.get('error', r.get('skipped', ''))[:90]} ||||")
            continue
        s = sd.get(r["L"], {})
        lines.append(f"| {r['mechanism']} | {r.get('backend', '')} | {r['L']} | {r['fwd_ms']:.3f} | "
                     f"{r.get('fwdbwd_ms', math.nan):.3f} | "
                     f"{_ratio(s, r, 'fwd_ms')} | {_ratio(s, r, 'fwdbwd_ms')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_gpu_sparse.json", help="JSON results (rewritten after every row)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--pattern-flex-lengths", type=int, nargs="+", default=[16384],
                   help="lengths at which bigbird/longformer also run on the flex backend (a compile each)")
    p.add_argument("--flex-block-sizes", type=int, nargs="+", default=[64, 128], help="flex backend block sizes")
    p.add_argument("--only-methods", nargs="+", default=None,
                   help="engine rows of these methods only (sdpa, flexattention, flex-b64, triton-b64, flex, triton)")
    p.add_argument("--check-backends", nargs="+", default=None, help="backends the check section runs")
    p.add_argument("--mech-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="dtype of the mechanisms section's modules and inputs (module.to(dtype)); default "
                        "bfloat16 on CUDA, float32 under --smoke")
    p.add_argument("--mech-lengths", type=int, nargs="+", default=[16384])
    p.add_argument("--mech-backends", nargs="+", default=["auto"],
                   help="run each mechanism once per backend named here ('auto': the module's choice; e.g. "
                        "'auto triton' also forces the content-based mechanisms onto the triton kernels)")
    p.add_argument("--mechanisms", nargs="+", default=DEFAULT_MECHANISMS)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[64, 128], help="triton backend block sizes")
    p.add_argument("--sections", nargs="+", default=["check", "engine", "mechanisms"],
                   choices=["check", "engine", "mechanisms"])
    p.add_argument("--budget", type=float, default=240.0, help="seconds; later timing rows are skipped")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes (TRITON_INTERPRET=1): the script runs")
    args = p.parse_args(argv)
    global SMOKE
    SMOKE = args.smoke
    if args.smoke:
        device = torch.device("cpu")
        args.lengths, args.mech_lengths, args.block_sizes, args.pattern_flex_lengths = [256], [256], [64], [256]
        args.flex_block_sizes = [64]
        backends, dtype = ["torch", "triton"], torch.float32
        from attnkit_sparse.engine import flex as flex_backend
        flex_backend.COMPILE = False
    else:
        if not torch.cuda.is_available():
            print("CUDA is not available: run with --smoke on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        backends, dtype = ["triton", "flex", "torch"], torch.bfloat16
        from torch import _dynamo
        _dynamo.config.cache_size_limit = 256                   # a compile per length and mask, not eager fallback
        _dynamo.config.accumulated_cache_size_limit = 4096
    import triton
    meta = {"command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "B": B, "H": H, "D": D,
            "window": WINDOW, "smoke": args.smoke}
    run = Run(Path(args.out), meta)
    print("meta", json.dumps(meta), flush=True)
    if "check" in args.sections:
        check(run, device, 200 if not args.smoke else 64, args.check_backends or backends)
    if "engine" in args.sections:
        engine(run, device, args.lengths, dtype, args.budget, args.block_sizes, args.pattern_flex_lengths,
               args.flex_block_sizes, args.only_methods)
    if "mechanisms" in args.sections:
        mechanisms(run, device, args.mechanisms if not args.smoke else args.mechanisms[:3], args.mech_lengths,
                   getattr(torch, args.mech_dtype or ("float32" if args.smoke else "bfloat16")), args.budget,
                   tuple(args.mech_backends))
    md = tables(run.data)
    Path(args.out).with_suffix(".md").write_text(md + "\n")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
