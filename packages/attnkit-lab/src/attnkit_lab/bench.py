"""``attnkit bench``: time and peak memory against exact SDPA over a sweep of lengths.

For each length every implementation and the exact baseline
(``torch.nn.functional.scaled_dot_product_attention``) get the same inputs
``q, k, v ~ N(0, 1)`` of shape (B, H, L, D). Per mode (``fwd``: forward under
``torch.no_grad()``, module in eval mode; ``fwdbwd``: forward and backward of
``(out * g).sum()`` for a fixed random ``g``, module in train mode):

0. a length beyond an implementation's ``limits`` (``max_length``,
   ``length_multiple``; attnkit contract 2) is recorded as ``skipped`` with
   the limit (``max_length 512``), without calling it;
1. first call, timed on its own and reported as ``first_call_s`` (it includes
   one-off costs such as numba compilation); a refusal (this length, causal,
   dtype...) is recorded as ``skipped`` and the sweep goes on; running out of
   memory is ``oom``; when the first call and a second one (the first may be
   compilation) both take longer than ``time_limit`` it is ``timeout``.
   After ``oom`` or ``timeout`` longer lengths of that implementation are not
   tried (recorded as such);
2. warm-up: ``warmup`` untimed calls of every implementation at this length
   and mode, after all first calls (so no compilation or first touch of
   another implementation falls between warm-up and timing);
3. ``repeats`` rounds; each round times every implementation once, in an
   order rotated every round, so drift of the machine (other load, clocks)
   hits all of them alike. The median is reported with its spread: min,
   quartiles, max, interquartile range and ``spread`` = IQR / median;
4. one more call measures peak memory (see :mod:`attnkit_lab.measure`).

Ctrl-C stops the sweep: what was measured is written (``"interrupted": true``)
and :class:`~attnkit_lab.interrupts.Interrupted` is raised.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.aux import clear_aux_losses

from . import names as names_mod
from .interrupts import Interrupted, is_interrupt, raise_if_interrupt
from .measure import MEMORY_METHOD, peak_memory, time_call
from .progress import Progress
from .results import RunDir, environment, fmt_bytes, fmt_seconds, format_table, machine_line

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("fwd", "fwdbwd")


@dataclass
class BenchSettings:
    """What to measure. ``lengths`` are sequence lengths L (= S)."""

    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    causal: bool = False
    repeats: int = 5
    warmup: int = 1
    time_limit: float = 10.0
    modes: tuple[str, ...] = MODES
    memory: bool = True
    seed: int = 0


@dataclass
class _Candidate:
    label: str
    call: Callable[..., torch.Tensor]
    module: torch.nn.Module | None = None
    stopped: str = ""     # reason longer lengths are not tried


def _status_of(exc: BaseException) -> str:
    if names_mod.is_oom(exc):
        return "oom"
    if names_mod.is_refusal(exc):
        return "skipped"
    return "error"


def _make_call(c: _Candidate, mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor) -> Callable[[], None]:
    if mode == "fwd":
        if c.module is not None:
            c.module.eval()

        def fwd() -> None:
            with torch.no_grad():
                c.call(q, k, v)
        return fwd
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if c.module is not None:
        c.module.train()

    def fwdbwd() -> None:
        out = c.call(qg, kg, vg)
        out.backward(g)
        qg.grad = kg.grad = vg.grad = None
        if c.module is not None:
            c.module.zero_grad(set_to_none=True)
            clear_aux_losses(c.module)   # uncollected, each call's loss would keep its graph alive
    return fwdbwd


def crossover(points: list[tuple[int, float | None, bool]]) -> dict[str, Any]:
    """Where an implementation becomes faster than SDPA.

    ``points``: (length, time ratio to SDPA, clearly faster). "Clearly faster"
    means the ratio is below 1 and the interquartile ranges of the two timings
    do not overlap, so noise on a shared machine does not make a tie look like
    a win. The crossover is the shortest measured length from which it is
    clearly faster at every longer measured length; ``estimate`` interpolates
    log(ratio) over log(length) between the last length where it was slower
    (ratio >= 1) and the first where it was faster.
    """
    pts = sorted((L, r, bool(f)) for L, r, f in points if r is not None and r > 0 and math.isfinite(r))
    if not pts:
        return {"length": None, "estimate": None, "text": "n/a"}
    not_faster = [i for i, (_, _, f) in enumerate(pts) if not f]
    if not not_faster:
        return {"length": pts[0][0], "estimate": None, "text": f"≤ {pts[0][0]} (faster at every length measured)"}
    i = not_faster[-1]
    if i == len(pts) - 1:
        return {"length": None, "estimate": None, "text": f"> {pts[-1][0]} (not faster at the longest length)"}
    (L0, r0, _), (L1, r1, _) = pts[i], pts[i + 1]
    if r0 >= 1 > r1:
        t = math.log(r0) / (math.log(r0) - math.log(r1))
        est = math.exp(math.log(L0) + t * (math.log(L1) - math.log(L0)))
        return {"length": L1, "estimate": est, "text": f"≈ {est:,.0f} (slower at {L0}, faster from {L1})"}
    return {"length": L1, "estimate": None, "text": f"{L1} (a tie at {L0}, faster from {L1})"}


def _module_call(mod: torch.nn.Module, causal: bool) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mod(q, k, v, causal=causal)
    return call


def _sdpa(causal: bool) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def run_bench(choices: list[names_mod.AttentionChoice], settings: BenchSettings, out: RunDir, *,
              show_progress: bool = True, preset: str | None = None, strict_build: bool = True) -> dict[str, Any]:
    """Measure ``choices`` against SDPA and write results into ``out`` (an opened RunDir).

    ``strict_build``: a choice that cannot be built is a usage error (names
    given explicitly); otherwise it is recorded as skipped (default sweep).
    """
    device = torch.device(settings.device)
    dtype = DTYPES[settings.dtype]
    records: list[dict[str, Any]] = []
    candidates = [_Candidate("sdpa", _sdpa(settings.causal))]
    build_failures: dict[str, str] = {}
    for i, ch in enumerate(choices):
        try:
            mod = names_mod.build(ch, num_heads=settings.heads, head_dim=settings.head_dim, seed=settings.seed + i)
            mod = mod.to(device=device, dtype=dtype)
        except Exception as e:  # noqa: BLE001
            raise_if_interrupt(e)
            if strict_build:
                raise names_mod.UsageError(f"cannot build {ch.label!r}: {e}") from None
            build_failures[ch.label] = names_mod.describe_error(e)
            continue
        candidates.append(_Candidate(ch.label, _module_call(mod, settings.causal), mod))
    for label, why in build_failures.items():
        for L in settings.lengths:
            for mode in settings.modes:
                records.append({"label": label, "length": L, "mode": mode, "status": "skipped",
                                "note": f"cannot build: {why}"})

    hint = thread_hint(choices, device)
    if hint and show_progress:
        print(f"note: {hint}", file=sys.stderr)
    total = len(settings.lengths) * len(settings.modes)
    interrupted: BaseException | None = None
    where = {"at": "the start"}
    try:
        with Progress(total, "bench", enabled=show_progress) as bar:
            for L in settings.lengths:
                for recs in _measure_length(candidates, L, settings, device, dtype, bar, where):
                    records.extend(recs)
                    bar.update(1)
    except BaseException as e:
        if not is_interrupt(e):
            raise
        interrupted = e

    labels = [c.label for c in candidates[1:]] + list(build_failures)
    _add_ratios(records)
    summary = _summaries(records, labels, settings)
    env = environment(str(device))
    payload = {
        "command": "bench",
        "preset": preset,
        "settings": asdict(settings),
        "baseline": "torch.nn.functional.scaled_dot_product_attention",
        "memory_method": MEMORY_METHOD.get(device.type, ""),
        "environment": env,
        "interrupted": interrupted is not None,
        "labels": labels,
        "crossover": summary,
        "records": records,
    }
    text = render_tables(records, labels, settings, summary, env)
    if interrupted is not None:
        text += (f"\n**Interrupted** (Ctrl-C) at {where['at']}: the tables hold what was measured before "
                 "(lengths and modes not reached are missing).\n")
    if hint:
        text += f"\nNote: {hint}\n"
    out.write_json("results.json", payload)
    out.write_csv("results.csv", records, CSV_COLUMNS)
    out.write_text("table.md", text)
    if interrupted is not None:
        print(text)
        raise Interrupted(f"bench {where['at']}") from interrupted
    if any(r["status"] == "ok" for r in records):
        from .plotting import bench_figure

        bench_figure(out.file("bench.png"), records, labels, _title(settings, env), settings.modes, settings.memory)
    print(text)
    return payload


CSV_COLUMNS = ["label", "length", "mode", "status", "median_s", "min_s", "q1_s", "q3_s", "max_s", "iqr_s", "spread",
               "repeats", "warmup_calls", "first_call_s", "peak_bytes", "time_ratio", "clearly_faster",
               "memory_ratio", "note"]


def limit_reason(module: torch.nn.Module | None, length: int) -> str | None:
    """Why ``module`` cannot take sequences of ``length`` (L = S), from its ``limits``; None if it can.

    Asks ``module.limits.why_not(L, L)`` (attnkit's contract 2:
    :class:`attnkit.Limits` with ``max_length``, ``equal_length``,
    ``length_multiple``), e.g. ``"max_length 512"``. A ``limits`` object
    without ``why_not`` is read field by field; a module without ``limits``
    (or whose property fails) is simply run, and its own call decides.
    """
    if module is None:
        return None
    try:
        limits = getattr(module, "limits", None)
        why_not = getattr(limits, "why_not", None)
        if callable(why_not):
            why = why_not(length, length)
            return str(why) if why else None
    except Exception as e:  # noqa: BLE001 - a broken property: let the call itself decide
        raise_if_interrupt(e)
        return None
    if limits is None:
        return None
    max_length = getattr(limits, "max_length", None)
    if max_length is not None and length > max_length:
        return f"max_length {max_length}"
    multiple = getattr(limits, "length_multiple", None)
    if multiple and length % multiple:
        return f"length_multiple {multiple}"
    return None


def _measure_length(candidates: list[_Candidate], L: int, settings: BenchSettings, device: torch.device,
                    dtype: torch.dtype, bar: Progress, where: dict[str, str]) -> Iterator[list[dict[str, Any]]]:
    """Yield the records of every mode at length ``L``, one list per mode; ``where['at']``: what runs now."""
    where["at"] = f"L={L}"
    gen = torch.Generator(device="cpu")
    gen.manual_seed(settings.seed * 1_000_003 + L)
    shape = (settings.batch, settings.heads, L, settings.head_dim)
    failure: tuple[str, str] | None = None
    need = 4 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    avail = available_memory(device)
    if avail is not None and need > avail:
        # never try: on Linux an allocation beyond free memory may succeed and get the process killed
        failure = ("oom", f"the inputs q, k, v, g of shape {tuple(shape)} need {fmt_bytes(need)}, more than "
                          f"the {fmt_bytes(avail)} available")
    else:
        try:
            q, k, v, g = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
        except Exception as e:  # noqa: BLE001 - inputs too large for this machine: no implementation runs
            raise_if_interrupt(e)
            failure = ("oom" if names_mod.is_oom(e) else "error",
                       f"cannot allocate the inputs {tuple(shape)}: {names_mod.describe_error(e)}")
    if failure is not None:     # recorded outside the except block: the failed allocation is released
        _free(device)
        status = {c.label: ("skipped", c.stopped) if c.stopped else failure for c in candidates}
        for c in candidates:
            if not c.stopped:
                c.stopped = f"not run: the inputs could not be allocated at L={L}"
        for mode in settings.modes:
            yield [{"label": c.label, "length": L, "mode": mode, "status": status[c.label][0],
                    "note": status[c.label][1]} for c in candidates]
        return
    try:
        for mode in settings.modes:
            where["at"] = f"L={L}, {mode}"
            bar.set_postfix(L=L, mode=mode)
            yield _measure_mode(candidates, L, mode, settings, device, q, k, v, g)
    finally:
        del q, k, v, g
        _free(device)


def _measure_mode(candidates: list[_Candidate], L: int, mode: str, settings: BenchSettings, device: torch.device,
                  q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    runnable: list[tuple[_Candidate, Callable[[], None], float]] = []
    # 1. first calls: one-off costs, refusals, out of memory, time limit
    for c in candidates:
        rec = {"label": c.label, "length": L, "mode": mode}
        if c.stopped:
            records.append({**rec, "status": "skipped", "note": c.stopped})
            continue
        why = limit_reason(c.module, L)
        if why is not None:
            records.append({**rec, "status": "skipped", "note": why})
            continue
        try:
            call = _make_call(c, mode, q, k, v, g)
            first = time_call(call, device)
        except Exception as e:  # noqa: BLE001 - one implementation never stops the sweep
            raise_if_interrupt(e)
            st = _status_of(e)
            records.append({**rec, "status": st, "note": names_mod.describe_error(e)})
            if st == "oom":
                c.stopped = f"not run: out of memory at L={L}"
            _free(device)
            continue
        if first > settings.time_limit:
            # the first call may be one-off compilation (numba): judge by a second call
            try:
                second = time_call(call, device)
            except Exception as e:  # noqa: BLE001
                raise_if_interrupt(e)
                records.append({**rec, "status": _status_of(e), "first_call_s": first,
                                "note": names_mod.describe_error(e)})
                continue
            if second > settings.time_limit:
                note = (f"a call took {second:.2f} s > --time-limit {settings.time_limit:g} s "
                        f"(first call {first:.2f} s)")
                records.append({**rec, "status": "timeout", "first_call_s": first, "note": note})
                c.stopped = f"not run: exceeded the time limit at L={L}"
                continue
        runnable.append((c, call, first))
    # 2. warm-up of every (implementation, length, mode), after every first call (compilation
    #    and first-touch costs of the others are over) and right before the timed rounds
    failed: dict[str, str] = {}
    for c, call, _ in runnable:
        try:
            for _ in range(settings.warmup):
                call()
        except Exception as e:  # noqa: BLE001
            raise_if_interrupt(e)
            failed[c.label] = f"warm-up: {names_mod.describe_error(e)}"
    # 3. timed rounds, the order rotated every round
    times: dict[str, list[float]] = {c.label: [] for c, _, _ in runnable}
    for r in range(settings.repeats):
        order = runnable[r % len(runnable):] + runnable[: r % len(runnable)] if runnable else []
        for c, call, _ in order:
            if c.label in failed:
                continue
            try:
                times[c.label].append(time_call(call, device))
            except Exception as e:  # noqa: BLE001
                raise_if_interrupt(e)
                failed[c.label] = names_mod.describe_error(e)
    # 4. statistics and peak memory
    for c, call, first in runnable:
        rec = {"label": c.label, "length": L, "mode": mode, "first_call_s": first}
        if c.label in failed:
            records.append({**rec, "status": "error", "note": failed[c.label]})
            continue
        rec.update(status="ok", **timing_stats(times[c.label]), warmup_calls=settings.warmup)
        if settings.memory:
            try:
                rec["peak_bytes"] = peak_memory(call, device)
            except Exception as e:  # noqa: BLE001
                raise_if_interrupt(e)
                rec["note"] = f"memory not measured: {names_mod.describe_error(e)}"
        records.append(rec)
    return records


def timing_stats(times: list[float]) -> dict[str, Any]:
    """Median, min, quartiles, max, interquartile range and relative spread of timings (seconds).

    ``spread`` is the interquartile range over the median. Quartiles use the
    exclusive method and are clamped to [min, max] (with two or three timings
    they are the extremes).
    """
    ts = sorted(times)
    med = statistics.median(ts)
    if len(ts) >= 2:
        quart = statistics.quantiles(ts, n=4)
        q1, q3 = max(ts[0], quart[0]), min(ts[-1], quart[2])
    else:
        q1 = q3 = ts[0]
    return {"median_s": med, "min_s": ts[0], "q1_s": q1, "q3_s": q3, "max_s": ts[-1], "iqr_s": q3 - q1,
            "spread": (q3 - q1) / med if med > 0 else None, "repeats": len(ts)}


def thread_hint(choices: list[names_mod.AttentionChoice], device: torch.device) -> str:
    """A warning when CPU numba kernels will share cores with PyTorch's spinning OpenMP threads."""
    if device.type != "cpu" or os.environ.get("OMP_WAIT_POLICY"):
        return ""
    numba = [c.label for c in choices if "numba" in names_mod.resolve_spec(c.name).capabilities.backends]
    if not numba:
        return ""
    return (f"{', '.join(numba)} may run numba kernels on CPU; PyTorch's OpenMP threads spin-wait after each op "
            "and compete with numba's threads on few cores, which can slow short calls many times over. "
            "Timings here are what this environment gives; OMP_WAIT_POLICY=PASSIVE avoids the contention "
            "(see docs/lab/bench.md).")


def available_memory(device: torch.device) -> int | None:
    """Bytes that can be allocated on ``device`` now (CPU: MemAvailable), or None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, ValueError, RuntimeError):
        pass
    return None


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _add_ratios(records: list[dict[str, Any]]) -> None:
    base = {(r["length"], r["mode"]): r for r in records if r["label"] == "sdpa" and r["status"] == "ok"}
    for r in records:
        b = base.get((r["length"], r["mode"]))
        if r["label"] == "sdpa" or r["status"] != "ok" or b is None:
            continue
        r["time_ratio"] = r["median_s"] / b["median_s"] if b["median_s"] else None
        r["clearly_faster"] = bool(r["time_ratio"] is not None and r["time_ratio"] < 1
                                   and r.get("q3_s", r["median_s"]) < b.get("q1_s", b["median_s"]))
        if r.get("peak_bytes") is not None and b.get("peak_bytes"):
            r["memory_ratio"] = r["peak_bytes"] / b["peak_bytes"]


def _summaries(records: list[dict[str, Any]], labels: list[str], settings: BenchSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label in labels:
        per = {}
        for mode in settings.modes:
            pts = [(r["length"], r.get("time_ratio"), r.get("clearly_faster", False)) for r in records
                   if r["label"] == label and r["mode"] == mode and r["status"] == "ok"]
            per[mode] = crossover(pts)
        firsts = [r for r in records if r["label"] == label and r.get("first_call_s") is not None]
        per["first_call_s"] = min(firsts, key=lambda r: r["length"])["first_call_s"] if firsts else None
        out[label] = per
    return out


def _title(settings: BenchSettings, env: dict[str, Any]) -> str:
    return (f"B={settings.batch}, H={settings.heads}, D={settings.head_dim}, {settings.dtype}, "
            f"{'causal' if settings.causal else 'non-causal'}, {env.get('device')}; medians of {settings.repeats}")


def _cell(r: dict[str, Any] | None, key: str, ratio_key: str | None) -> str:
    if r is None:
        return "—"
    if r["status"] != "ok":
        return r["status"]
    val = fmt_seconds(r.get(key)) if key == "median_s" else fmt_bytes(r.get(key))
    if key == "median_s" and r.get("repeats", 0) >= 2 and r.get("spread") is not None:
        half = 50 * r["spread"]         # half the interquartile range, in % of the median
        val += f" ±{half:.0f}%" if half >= 1 else " ±<1%"
    if ratio_key and r.get(ratio_key) is not None:
        val += f" ({r[ratio_key]:.2f}×)"
    return val


def render_tables(records: list[dict[str, Any]], labels: list[str], settings: BenchSettings,
                  summary: dict[str, Any], env: dict[str, Any]) -> str:
    """Markdown: a time and a memory table per mode, the crossover table and notes."""
    index = {(r["label"], r["length"], r["mode"]): r for r in records}
    parts = [f"# attnkit bench\n\n{_title(settings, env)}\n\nMachine: {machine_line(env)}\n\n"
             f"Command: `{env['command']}`\n\nCells: median of the timed rounds ± half their interquartile range "
             f"in % of the median (ratio to SDPA; < 1 is faster / smaller). Every implementation had "
             f"{settings.warmup} untimed warm-up call(s) at every length and mode before timing; min, "
             f"quartiles and max of every timing are in results.json and results.csv."]
    cols = ["L", "SDPA"] + labels
    for mode in settings.modes:
        for key, ratio, what in (("median_s", "time_ratio", "time"), ("peak_bytes", "memory_ratio", "peak memory")):
            if key == "peak_bytes" and not settings.memory:
                continue
            rows = []
            for L in settings.lengths:
                rows.append([L, _cell(index.get(("sdpa", L, mode)), key, None)]
                            + [_cell(index.get((lb, L, mode)), key, ratio) for lb in labels])
            table = format_table(rows, cols, align="r" * len(cols))
            parts.append(f"## {MODE_NAMES.get(mode, mode)}: {what}\n\n" + table)
    rows = [[lb] + [summary[lb][m]["text"] for m in settings.modes]
            + [fmt_seconds(summary[lb]["first_call_s"])] for lb in labels]
    parts.append("## Crossover length (faster than SDPA from)\n\n"
                 + format_table(rows, ["attention"] + [MODE_NAMES.get(m, m) for m in settings.modes]
                                + ["first call (shortest L)"], align="l" * (len(settings.modes) + 2)))
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["status"] != "ok" and r.get("note"):
            groups.setdefault((r["label"], r["status"], r["note"]), []).append(r)
    if groups:
        lines = []
        for (label, st, note), rs in groups.items():
            lengths = ", ".join(str(L) for L in sorted({r["length"] for r in rs}))
            modes = ", ".join(m for m in settings.modes if any(r["mode"] == m for r in rs))
            lines.append(f"- {label} (L = {lengths}; {modes}): {st}: {note}")
        parts.append("## Not measured\n\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


MODE_NAMES = {"fwd": "Forward", "fwdbwd": "Forward + backward"}
