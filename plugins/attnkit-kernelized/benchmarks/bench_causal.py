"""Benchmark the causal kernelized attentions against plain-torch and SDPA baselines.

CPU (always): float32, (B, H, D) = (1, 8, 64), 256 random features, lengths
1K..64K, forward (under ``torch.no_grad``) and forward+backward, for

* ``performer``, ``linear`` and ``fast-weight`` (automatic backend: the numba kernels on CPU),
* ``performer-torch``: the same module forced onto the chunked torch path,
* ``naive``: a plain-torch cumsum-of-outer-products causal linear attention on
  the same FAVOR+ features (materialises (B, H, L, M, E); capped in length),
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``.

CUDA (when present): ``performer``/``linear`` on the triton kernels and SDPA.

Runs are interleaved (every method once per round, the order rotated each
round), the first ``--warmup`` rounds are dropped and the median of the rest
is reported, with the CPU load other processes put on the machine while each
block ran ("foreign load", in cores; on a shared machine rerun blocks where it
is not ~0). Peak memory is measured separately: on CPU in a fresh process per
(method, L, mode), as the rise of the process's peak RSS (``VmHWM`` after
resetting it through ``/proc/self/clear_refs``, Linux only) over the RSS just
before the call, after a small warm-up call that loads the kernels; on CUDA
``torch.cuda.max_memory_allocated`` over the memory allocated before the call. The numba compile time is measured in a
fresh interpreter with an empty ``NUMBA_CACHE_DIR`` (cold) and again with the
cache it wrote (warm).

Usage::

    python plugins/attnkit-kernelized/benchmarks/bench_causal.py --output bench_causal.json
    python .../bench_causal.py --lengths 1024 8192 --repeats 3 --no-memory --no-compile-time

Nothing here is a test: timings are figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

DEFAULT_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]


# ------------------------------------------------------------------ methods
def naive_causal(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain torch: cumsum over positions of the outer products phi_k v^T (O(L·M·E) memory)."""
    kv = torch.cumsum(phi_k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)      # (B, H, L, M, E)
    num = torch.einsum("bhlm,bhlme->bhle", phi_q, kv)
    den = torch.einsum("bhlm,bhlm->bhl", phi_q, torch.cumsum(phi_k, dim=2))
    return num / den.unsqueeze(-1)


def make_methods(args, device: str) -> dict[str, tuple[Callable, int | None, int | None]]:
    """name -> (fn(q, k, v) -> out, max length forward, max length forward+backward)."""
    import attnkit

    common = {"num_heads": args.heads, "head_dim": args.head_dim}
    torch.manual_seed(0)
    perf = attnkit.build("performer", num_features=args.features, **common).to(device)
    lin = attnkit.build("linear", **common).to(device)
    fw = attnkit.build("fast-weight", **common).to(device)
    methods: dict[str, tuple[Callable, int | None, int | None]] = {
        "performer": (lambda q, k, v: perf(q, k, v, causal=True), None, None),
        "linear": (lambda q, k, v: lin(q, k, v, causal=True), None, None),
        "fast-weight": (lambda q, k, v: fw(q, k, v, causal=True), None, None),
    }
    if device == "cpu":
        perf_torch = attnkit.build("performer", num_features=args.features, backend="torch", **common)
        perf_torch.load_state_dict(perf.state_dict())

        def naive(q, k, v):
            phi_q, phi_k = perf.feature_pair(q, k, causal=True)
            return naive_causal(phi_q, phi_k, v)

        methods["performer-torch"] = (lambda q, k, v: perf_torch(q, k, v, causal=True), args.max_torch_len,
                                      args.max_torch_len)
        methods["naive"] = (naive, args.max_naive_len, args.max_naive_bwd_len)
    methods["sdpa"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                       args.max_sdpa_len, args.max_sdpa_bwd_len)
    if device == "cpu" and args.backends:
        # every mechanism on each backend, side by side (auto = the rows named after the mechanism)
        def forced(name, backend, cap=None, **opts):
            torch.manual_seed(0)
            mod = attnkit.build(name, backend=backend, **common, **opts)
            return (lambda q, k, v: mod(q, k, v, causal=True), cap, cap)

        for backend in ("torch", "numba"):
            methods[f"linear-{backend}"] = forced("linear", backend)
            methods[f"rfa-{backend}"] = forced("rfa", backend, num_features=args.features // 2, seed=0)
        # fast-weight: the chunked UT-transform form on both backends (numba's is chunked too since session 64;
        # these rows were called fast-weight-chunked and fast-weight-loop before session 65)
        methods["fast-weight-torch"] = forced("fast-weight", "torch")
        methods["fast-weight-numba"] = forced("fast-weight", "numba", args.max_loop_len)
    if args.only:
        methods = {n: m for n, m in methods.items() if n in args.only}
    return methods


def matmul_rate(seconds: float = 3.0, n: int = 1024) -> float:
    """This machine's float32 matmul rate in FLOP/s at torch's thread count: the median of repeated
    (n x n) @ (n x n) products (2 n^3 FLOPs each), measured in the same run as the attention."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def start_contention(threads: int) -> subprocess.Popen:
    """A second process keeping ``threads`` cores busy (matmuls in a loop on ``threads`` torch threads) for the
    whole run: the same load for every method of a block (ended by :func:`stop_contention`). It runs with
    OpenMP's default wait policy whatever this process was started with (``OMP_WAIT_POLICY`` is dropped from
    its environment): a measurement of this process's setting must not change the load too."""
    code = (f"import torch; torch.set_num_threads({threads}); a = torch.randn(256, 256)\n"
            "while True:\n    a @ a")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def stop_contention(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


# ------------------------------------------------------------------ measuring
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _call(fn: Callable, q, k, v, grad_out, mode: str):
    if mode == "fwd":
        with torch.no_grad():
            return fn(q, k, v)
    out = fn(q, k, v)
    out.backward(grad_out)
    return out


def _busy_seconds() -> tuple[float, float]:
    """(CPU seconds all processes have used, CPU seconds this process has used), for the foreign load."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")   # all but idle, iowait
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory(fn: Callable, q, k, v, grad_out, mode: str, device: str) -> int | None:
    """Bytes the call needs on top of what was allocated before it (None if not measurable)."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _call(fn, q, k, v, grad_out, mode)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                           # reset VmHWM to the current RSS
        base = _rss_kib("VmRSS")
        _call(fn, q, k, v, grad_out, mode)
        return (_rss_kib("VmHWM") - base) * 1024
    except OSError:
        return None


def run_length(args, methods, L: int, mode: str, device: str, dtype: torch.dtype) -> list[dict]:
    q, k, v, grad_out = _inputs(args, L, mode, device, dtype)
    names = [n for n, (_, cap_f, cap_b) in methods.items()
             if (cap_f if mode == "fwd" else cap_b) is None or L <= (cap_f if mode == "fwd" else cap_b)]
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds = args.warmup + args.repeats
    busy0, own0, wall0 = *_busy_seconds(), time.perf_counter()
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = methods[name][0]
            for t in (q, k, v):
                t.grad = None
            _sync(device)
            t0 = time.perf_counter()
            _call(fn, q, k, v, grad_out, mode)
            _sync(device)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
        print(f"  L={L:>6} {mode:6} round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    busy1, own1 = _busy_seconds()
    # CPU seconds other processes used per wall second while this block ran (0 = a quiet machine)
    foreign = max(0.0, (busy1 - busy0) - (own1 - own0)) / (time.perf_counter() - wall0)
    print(f"  L={L:>6} {mode:6} foreign load {foreign:.2f} cores", file=sys.stderr, flush=True)
    rows = []
    for name in names:
        mem = None
        if args.memory and device == "cuda":
            for t in (q, k, v):
                t.grad = None
            mem = peak_memory(methods[name][0], q, k, v, grad_out, mode, device)
        rows.append({"method": name, "L": L, "mode": mode, "device": device, "foreign_load": foreign,
                     "median_s": statistics.median(times[name]), "times_s": times[name], "peak_bytes": mem})
    return rows


def _inputs(args, L: int, mode: str, device: str, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(L)
    shape = (args.batch, args.heads, L, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g, dtype=dtype).to(device) for _ in range(3))
    grad_out = torch.randn(shape, generator=g, dtype=dtype).to(device)
    if mode == "fwdbwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, grad_out


def memory_child(args, name: str, L: int, mode: str) -> None:
    """In a fresh process: peak RSS rise of one call (after a small warm-up call that loads kernels)."""
    dtype = getattr(torch, args.dtype)
    methods = make_methods(args, "cpu")
    fn = methods[name][0]
    wq, wk, wv, wg = _inputs(args, 128, mode, "cpu", dtype)
    _call(fn, wq, wk, wv, wg, mode)
    del wq, wk, wv, wg
    q, k, v, g = _inputs(args, L, mode, "cpu", dtype)
    print(json.dumps({"peak_bytes": peak_memory(fn, q, k, v, g, mode, "cpu")}))


def cpu_memory(args, rows: list[dict]) -> None:
    """Fill ``peak_bytes`` of the CPU rows at ``--memory-lengths``, one fresh process per measurement."""
    caps = {"fwd": {"naive": args.max_naive_len, "sdpa": args.max_sdpa_len, "performer-torch": args.max_torch_len},
            "fwdbwd": {"naive": args.max_naive_bwd_len, "sdpa": args.max_sdpa_bwd_len,
                       "performer-torch": args.max_torch_len}}
    for r in rows:
        if r["device"] != "cpu" or r["L"] not in args.memory_lengths:
            continue
        cap = caps[r["mode"]].get(r["method"])
        if cap is not None and r["L"] > cap:
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--_memory-child", r["method"], str(r["L"]), r["mode"],
               "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--batch", str(args.batch),
               "--features", str(args.features), "--dtype", args.dtype]
        if args.keep_freed_memory:
            cmd.append("--keep-freed-memory")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode == 0:
            r["peak_bytes"] = json.loads(res.stdout.strip().splitlines()[-1])["peak_bytes"]
        else:
            r["peak_error"] = res.stderr[-500:]
        print(f"  memory {r['method']} L={r['L']} {r['mode']}: {r.get('peak_bytes')}", file=sys.stderr, flush=True)


COMPILE_SNIPPET = r"""
import time, torch
t0 = time.perf_counter()
import attnkit
from attnkit_kernelized.linear import numba_ops
t_import = time.perf_counter() - t0
x = torch.rand(1, 2, 64, 16, requires_grad=True)
v = torch.randn(1, 2, 64, 8, requires_grad=True)
t0 = time.perf_counter()
with torch.no_grad():
    numba_ops.linear_attention(x, x, v, causal=True)
t_fwd = time.perf_counter() - t0
t0 = time.perf_counter()
numba_ops.linear_attention(x, x, v, causal=True)[0].sum().backward()
t_bwd = time.perf_counter() - t0
print(t_import, t_fwd, t_bwd)
"""


def compile_times() -> dict:
    """First-call times of the float32 numba kernels in fresh interpreters: cold cache, then warm."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold_cache", "warm_cache"):
            res = subprocess.run([sys.executable, "-c", COMPILE_SNIPPET], env=env, capture_output=True, text=True,
                                 check=True)
            t_import, t_fwd, t_bwd = (float(x) for x in res.stdout.split()[-3:])
            out[label] = {"import_s": t_import, "first_forward_s": t_fwd, "first_backward_s": t_bwd}
    return out


# ------------------------------------------------------------------ reporting
def ratio_table(rows: list[dict], args=None, rate: float | None = None) -> list[dict]:
    by = {(r["method"], r["L"], r["mode"], r["device"]): r["median_s"] for r in rows}
    out = []
    pairs = {"fast-weight-numba": ("fast-weight-torch",), "fast-weight": ("sdpa",), "linear-numba": ("linear-torch",),
             "rfa-numba": ("rfa-torch",), "performer": ("naive", "sdpa", "performer-torch"),
             "linear": ("naive", "sdpa")}
    for (method, L, mode, device), t in sorted(by.items(), key=lambda x: (x[0][3], x[0][2], x[0][0], x[0][1])):
        if method not in pairs:
            continue
        entry = {"method": method, "L": L, "mode": mode, "device": device, "median_s": t}
        for base in pairs[method]:
            if (base, L, mode, device) in by:
                entry[f"speedup_vs_{base}"] = by[(base, L, mode, device)] / t
        if method == "linear" and mode == "fwd" and rate and args is not None:
            # useful work of causal linear attention: the state update and the read-out, 4·B·H·L·D·E FLOPs
            flops = 4 * args.batch * args.heads * L * args.head_dim * args.head_dim
            entry["fraction_of_matmul_rate"] = flops / t / rate
        out.append(entry)
    return out


def markdown(rows: list[dict], ratios: list[dict]) -> str:
    lines = []
    for device in sorted({r["device"] for r in rows}):
        for mode in ("fwd", "fwdbwd"):
            sel = [r for r in rows if r["device"] == device and r["mode"] == mode]
            if not sel:
                continue
            methods = list(dict.fromkeys(r["method"] for r in sel))
            lengths = sorted({r["L"] for r in sel})
            label = "forward" if mode == "fwd" else "forward+backward"
            lines.append(f"\n{device}, {label}: median seconds (peak MiB)\n")
            lines.append("| L | " + " | ".join(methods) + " | foreign load |")
            lines.append("|---:|" + "---:|" * len(methods) + "---:|")
            for L in lengths:
                cells = []
                for m in methods:
                    r = next((r for r in sel if r["method"] == m and r["L"] == L), None)
                    if r is None:
                        cells.append("–")
                    else:
                        mem = "" if r["peak_bytes"] is None else f" ({r['peak_bytes'] / 2**20:.0f})"
                        cells.append(f"{r['median_s']:.4f}{mem}")
                load = max(r["foreign_load"] for r in sel if r["L"] == L)
                lines.append(f"| {L} | " + " | ".join(cells) + f" | {load:.2f} |")
    lines.append("\nspeedups (baseline median / ours):\n")
    bases = ["naive", "sdpa", "performer-torch", "linear-torch", "rfa-torch", "fast-weight-torch"]
    lines.append("| device | mode | method | L | " + " | ".join(f"vs {b}" for b in bases) + " | % matmul rate |")
    lines.append("|---|---|---|---:|" + "---:|" * (len(bases) + 1))
    for e in ratios:
        def fmt(key, e=e):
            return f"{e[key]:.1f}x" if key in e else "–"
        frac = e.get("fraction_of_matmul_rate")
        lines.append(f"| {e['device']} | {e['mode']} | {e['method']} | {e['L']} | "
                     + " | ".join(fmt(f"speedup_vs_{b}") for b in bases)
                     + f" | {'–' if frac is None else f'{100 * frac:.0f}%'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS, help="sequence lengths L")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per length (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="rounds dropped before measuring")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--features", type=int, default=256, help="performer random features M")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CPU, plus CUDA (triton kernels) when a GPU is present")
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--max-naive-len", type=int, default=8192, help="naive forward: longest L (memory L·M·E)")
    p.add_argument("--max-naive-bwd-len", type=int, default=2048, help="naive forward+backward: longest L")
    p.add_argument("--max-sdpa-len", type=int, default=16384, help="SDPA forward: longest L (time L^2)")
    p.add_argument("--max-sdpa-bwd-len", type=int, default=16384, help="SDPA forward+backward: longest L")
    p.add_argument("--max-torch-len", type=int, default=16384, help="performer-torch: longest L")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True, help="measure peak memory")
    p.add_argument("--memory-lengths", type=int, nargs="+", default=[4096, 16384, 65536],
                   help="CPU lengths at which peak memory is measured (one fresh process each)")
    p.add_argument("--_memory-child", nargs=3, metavar=("METHOD", "L", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--compile-time", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the numba first-call (compile) time in fresh interpreters")
    p.add_argument("--max-foreign-load", type=float, default=0.15,
                   help="rerun a (length, mode) block when other processes used more CPU cores than this")
    p.add_argument("--retry-busy", type=int, default=3, help="reruns of a busy block (the quietest is kept)")
    p.add_argument("--busy-wait", type=float, default=30.0, help="seconds to wait before rerunning a busy block")
    p.add_argument("--backends", action=argparse.BooleanOptionalAction, default=True,
                   help="also every mechanism forced onto each backend (torch, numba) side by side")
    p.add_argument("--max-loop-len", type=int, default=16384, help="fast-weight-numba: longest L")
    p.add_argument("--only", nargs="+", default=None, help="run only these methods")
    p.add_argument("--contention", type=int, default=0, metavar="THREADS",
                   help="run everything beside a second process keeping THREADS cores busy (0: none)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="call attnkit.cpu_memory.keep_freed_memory() first (process-wide: every method alike, SDPA "
                        "too; memory children take it as well)")
    p.add_argument("--output", default="bench_causal.json", help="JSON results file")
    p.add_argument("--merge", default=None,
                   help="an earlier results JSON: its blocks not rerun here are kept (e.g. to rerun a busy block)")
    args = p.parse_args(argv)
    kept = None
    if args.keep_freed_memory:
        from attnkit.cpu_memory import keep_freed_memory
        kept = keep_freed_memory()
    if args._memory_child:
        name, L, mode = args._memory_child
        memory_child(args, name, int(L), mode)
        return 0

    dtype = getattr(torch, args.dtype)
    devices = ["cpu"] if args.device in ("auto", "cpu") else []
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        devices.append("cuda")
    info = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "platform": platform.platform(), "processor": platform.processor(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "config": {k: v for k, v in vars(args).items()},
        "keep_freed_memory": kept,
    }
    try:
        import numba

        info["numba"] = numba.__version__
        info["numba_threads"] = numba.get_num_threads()
    except ImportError:
        pass
    if "cuda" in devices:
        info["gpu"] = torch.cuda.get_device_name()
    compile_info = compile_times() if args.compile_time and "cpu" in devices else None
    rows: list[dict] = []
    t_start = time.perf_counter()
    load = start_contention(args.contention) if args.contention else None
    info["contention_threads"] = args.contention
    info["matmul_flops_per_s"] = rate = matmul_rate()
    print(f"  float32 matmul rate: {rate / 1e9:.1f} GFLOP/s", file=sys.stderr, flush=True)
    for device in devices:
        methods = make_methods(args, device)
        for L in args.lengths:
            for mode in args.modes:
                best = None
                for attempt in range(1 + args.retry_busy):
                    block = run_length(args, methods, L, mode, device, dtype)
                    if best is None or block[0]["foreign_load"] < best[0]["foreign_load"]:
                        best = block
                    if best[0]["foreign_load"] <= args.max_foreign_load:
                        break
                    print(f"  L={L} {mode}: other processes used {block[0]['foreign_load']:.2f} cores; "
                          f"waiting {args.busy_wait:.0f} s and retrying ({attempt + 1}/{args.retry_busy})",
                          file=sys.stderr, flush=True)
                    if attempt < args.retry_busy:
                        time.sleep(args.busy_wait)
                rows.extend(best)
    if load is not None:
        stop_contention(load)
    info["loadavg_end"] = os.getloadavg()
    if args.memory and "cpu" in devices:
        cpu_memory(args, rows)
    info["wall_s"] = time.perf_counter() - t_start
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        rerun = {(r["L"], r["mode"], r["device"]) for r in rows}
        kept = [r for r in earlier["results"] if (r["L"], r["mode"], r["device"]) not in rerun]
        rows = sorted(kept + rows, key=lambda r: (r["device"], r["mode"], r["L"]))
        info["merged_from"] = {"file": args.merge, "info": earlier.get("info"),
                               "rerun_blocks": sorted([list(b) for b in rerun])}
        compile_info = compile_info or earlier.get("compile")
    ratios = ratio_table(rows, args, info["matmul_flops_per_s"])
    result = {"info": info, "compile": compile_info, "results": rows, "ratios": ratios}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(rows, ratios))
    if compile_info:
        print("\nnumba first call (float32, tiny shapes):", json.dumps(compile_info))
    print(f"\nwrote {args.output} ({info['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
