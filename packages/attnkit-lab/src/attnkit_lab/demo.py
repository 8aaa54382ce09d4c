"""``attnkit demo``: a quick bench, ``train mqar`` and an error report, in one directory.

Steps (quick preset, a handful of mechanisms):

1. ``bench``: forward and forward+backward against SDPA, lengths 256..8K;
2. ``train mqar``: the same small model with each attention;
3. ``error``: the approximate mechanisms against exact attention over budgets
   and lengths, on Gaussian inputs and on q/k/v captured from the model
   trained with exact attention in step 2.

Writes ``bench/``, ``train-mqar/``, ``error/`` and a ``README.md`` that lists
the equivalent single commands and the headline tables.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import attnkit

from . import names as names_mod
from .progress import status
from .results import RunDir, environment, machine_line


def _section(title: str) -> None:
    status(f"\n=== {title} ===")


def run_demo(choices: list[names_mod.AttentionChoice], out: RunDir, *, preset: str = "quick", seed: int = 0,
             device: str = "cpu", max_length: int = 8192, show_progress: bool = True) -> dict[str, Any]:
    from .bench import BenchSettings, run_bench
    from .cli import TRAIN_PRESETS, bench_presets, error_presets
    from .error import ErrorSettings, run_error
    from .tasks import MQARTask
    from .train import TrainSettings, run_train

    assert out.tmp is not None
    root = out.tmp
    labels = " ".join(c.label for c in choices)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    # 1. bench ------------------------------------------------------------------
    _section("1/3 bench")
    t0 = time.perf_counter()
    bs = BenchSettings(**bench_presets()[preset])
    bs.lengths = [L for L in bs.lengths if L <= max_length] or [min(bs.lengths)]
    if preset == "quick":
        bs.repeats = 3
    bs = replace(bs, seed=seed, device=device)
    with RunDir(root / "bench") as rd:
        run_bench(choices, bs, rd, show_progress=show_progress, preset=preset, strict_build=False)
    timings["bench"] = time.perf_counter() - t0

    # 2. train mqar ---------------------------------------------------------------
    _section("2/3 train mqar")
    t0 = time.perf_counter()
    task_opts, train_opts = TRAIN_PRESETS["mqar"][preset]
    task = MQARTask(**task_opts)
    ts = replace(TrainSettings(**train_opts), seed=seed, device=device)
    if preset == "quick":  # exact attention has solved it by then; keeps the demo within minutes
        ts.steps, ts.warmup = min(ts.steps, 200), min(ts.warmup, 20)
    with RunDir(root / "train-mqar") as rd:
        train_payload = run_train(task, choices, ts, rd, show_progress=show_progress, preset=preset)
    timings["train mqar"] = time.perf_counter() - t0

    # 3. error ----------------------------------------------------------------------
    approx = [c for c in choices if not attnkit.get_spec(c.name).exact]
    exact_runs = [r for r in train_payload["runs"]
                  if r["status"] == "ok" and r["checkpoint"] and attnkit.get_spec(r["name"]).exact]
    from_run = str(root / "train-mqar" / Path(exact_runs[0]["checkpoint"]).parent) if exact_runs else None
    if approx:
        _section("3/3 error")
        t0 = time.perf_counter()
        es = ErrorSettings(**error_presets()[preset])
        if preset == "quick":
            es.trials = 2
        es = replace(es, seed=seed, device=device)
        with RunDir(root / "error") as rd:
            run_error(approx, es, rd, from_run=from_run, show_progress=show_progress, preset=preset,
                      from_run_label="train-mqar" if from_run else None)
        timings["error"] = time.perf_counter() - t0
    else:
        status("3/3 error: skipped (no approximate mechanism among the demo's attentions)")

    timings["total"] = time.perf_counter() - t_all
    env = environment(device)
    lines = [
        "# attnkit demo",
        "",
        f"Machine: {machine_line(env)}",
        "",
        f"Attentions: {labels}; preset `{preset}`, seed {seed}.",
        "",
        "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
        "",
        "The same results, one command at a time:",
        "",
        "```",
        f"attnkit bench {labels} --preset {preset} --seed {seed} --lengths {','.join(map(str, bs.lengths))}"
        f" --repeats {bs.repeats} --out bench",
        f"attnkit train mqar --attention {labels} --preset {preset} --seed {seed} --steps {ts.steps}"
        f" --warmup {ts.warmup} --out train-mqar",
    ]
    if approx:
        lines.append(f"attnkit error {' '.join(c.label for c in approx)} --preset {preset} --seed {seed} "
                     f"--trials {es.trials}" + (" --from-run train-mqar" if from_run else "") + " --out error")
    lines += ["```", ""]
    for sub, title, img in (("bench", "Bench", "bench.png"), ("train-mqar", "Train: MQAR", "learning_curves.png"),
                            ("error", "Approximation error", "error.png")):
        table = root / sub / "table.md"
        if not table.exists():
            continue
        body = table.read_text(encoding="utf-8").split("\n", 1)[1].strip()
        lines += [f"## {title}", ""]
        if (root / sub / img).exists():
            lines += [f"![{title}]({sub}/{img})", ""]
        lines += [body.replace("\n## ", "\n### "), ""]
    (root / "README.md").write_text("\n".join(lines), encoding="utf-8")
    status(f"\ndemo finished in {timings['total']:.0f} s")
    return {"timings": timings}
