"""Evaluation with a cached segment memory against recomputing the same context from scratch, per segment.

A small language-model body (``attnkit.Transformer``: ``--depth`` blocks of
width ``--dim``, ``--heads`` heads) evaluates a long sequence segment by
segment (``--segment`` tokens). Attention length = memory + segment.

* ``cached``: ``transformer-xl`` with ``mem_len`` = attention length - segment,
  ``Transformer.step`` per segment (the keys/values of earlier segments come
  from the state);
* ``recompute (transformer-xl)``: the same model, no state: every segment
  re-runs the whole context (attention length tokens ending with the
  segment) from scratch and keeps the last ``segment`` outputs;
* ``recompute (softmax)``: the same for a ``softmax`` (SDPA) model of the
  same shape, the vanilla-Transformer evaluation the paper compares with.

Per-segment wall times (median over the measured segments), their ratios,
and for the cached path the medians of early and late segments once the
memory is full (flat cost: memory is bounded by ``mem_len``). CPU, float32,
no autograd. Run under ``flock /tmp/attnkit-bench.lock``; prints
``uptime`` before and after.

    python plugins/attnkit-memory/benchmarks/bench_memory.py --lengths 4096,8192 --out results/bench_memory_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

import attnkit


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:  # pragma: no cover
        return "n/a"


def build(attention: str, args, **options) -> attnkit.Transformer:
    torch.manual_seed(0)
    return attnkit.Transformer(args.dim, args.depth, args.heads, attention=attention, mlp_ratio=4.0,
                               attention_options=options).eval()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.no_grad()
def run_length(length: int, args) -> dict:
    seg = args.segment
    mem = length - seg
    total_segments = max(args.segments, 2 * -(-mem // seg) + 8)  # fill the memory, then as many again
    x = torch.randn(1, total_segments * seg, args.dim)
    txl = build("transformer-xl", args, mem_len=mem, backend=args.backend)
    soft = build("softmax", args)

    state = txl.init_state(1)
    cached = []
    for s in range(total_segments):
        part = x[:, s * seg:(s + 1) * seg]

        def go(part=part):
            nonlocal state
            _, state = txl.step(part, state)
        cached.append(timed(go))
    full_from = -(-mem // seg)                          # first segment with a full memory
    mem_sizes = sorted({tuple(st.data["k"].shape) for st in state})
    steady = cached[full_from:]
    half = len(steady) // 2
    early, late = steady[:half], steady[half:]

    # recompute: segments whose whole context exists, the last ones
    recompute = {"transformer-xl": [], "softmax": []}
    for s in range(total_segments - args.recompute_segments, total_segments):
        end = (s + 1) * seg
        ctx = x[:, end - length:end]
        recompute["transformer-xl"].append(timed(lambda ctx=ctx: txl(ctx, causal=True)[:, -seg:]))
        recompute["softmax"].append(timed(lambda ctx=ctx: soft(ctx, causal=True)[:, -seg:]))
    med_c = statistics.median(steady)
    out = {
        "attention_length": length, "segment": seg, "mem_len": mem, "segments": total_segments,
        "cached_median_s": med_c,
        "cached_early_median_s": statistics.median(early), "cached_late_median_s": statistics.median(late),
        "cached_fill_median_s": statistics.median(cached[:full_from]) if full_from else None,
        "memory_shapes": [list(m) for m in mem_sizes],
        "recompute_txl_median_s": statistics.median(recompute["transformer-xl"]),
        "recompute_softmax_median_s": statistics.median(recompute["softmax"]),
        "cached_all_s": cached,
        "recompute_txl_all_s": recompute["transformer-xl"],
        "recompute_softmax_all_s": recompute["softmax"],
    }
    out["speedup_vs_recompute_txl"] = out["recompute_txl_median_s"] / med_c
    out["speedup_vs_recompute_softmax"] = out["recompute_softmax_median_s"] / med_c
    out["late_over_early"] = out["cached_late_median_s"] / out["cached_early_median_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192", help="attention lengths (memory + segment)")
    p.add_argument("--segment", type=int, default=128)
    p.add_argument("--segments", type=int, default=64,
                   help="segments evaluated with the cache (at least: fill the memory twice)")
    p.add_argument("--recompute-segments", type=int, default=3, help="segments timed when recomputing")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto", help="transformer-xl's backend: auto (sdpa), sdpa or torch")
    p.add_argument("--out", default=None, help="write the results as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    before = uptime()
    print(f"uptime before: {before}")
    rows = []
    for length in [int(s) for s in args.lengths.split(",")]:
        r = run_length(length, args)
        rows.append(r)
        print(f"attention length {length} (mem {r['mem_len']} + segment {r['segment']}), {r['segments']} segments: "
              f"cached {r['cached_median_s'] * 1e3:.1f} ms/segment (early {r['cached_early_median_s'] * 1e3:.1f}, "
              f"late {r['cached_late_median_s'] * 1e3:.1f}, late/early {r['late_over_early']:.2f}; memory "
              f"{r['memory_shapes']}); recompute transformer-xl {r['recompute_txl_median_s'] * 1e3:.0f} ms "
              f"({r['speedup_vs_recompute_txl']:.1f}x), recompute softmax (SDPA) "
              f"{r['recompute_softmax_median_s'] * 1e3:.0f} ms ({r['speedup_vs_recompute_softmax']:.1f}x)", flush=True)
    after = uptime()
    print(f"uptime after: {after}")
    if args.out:
        meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
                "threads": args.threads, "dtype": "float32", "backend": args.backend, "dim": args.dim,
                "depth": args.depth, "heads": args.heads, "uptime_before": before, "uptime_after": after,
                "command": "python plugins/attnkit-memory/benchmarks/bench_memory.py " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
