"""``attnkit demo``: a quick bench, ``train mqar`` and an error report, in one directory.

Steps (quick preset, a handful of mechanisms):

1. ``bench``: forward and forward+backward against SDPA, lengths 256..8K
   (3 timed rounds instead of the preset's 5);
2. ``train mqar``: the same small model with each attention (200 steps
   instead of the preset's 300);
3. ``error``: the approximate mechanisms against exact attention over budgets
   and lengths, on Gaussian inputs and on q/k/v captured from the model
   trained with exact attention in step 2 (2 trials instead of 3). A
   mechanism without a budget option (``linear``: its state size is fixed by
   the head dimension) is measured at its default configuration, which the
   error table states.

Writes ``bench/``, ``train-mqar/``, ``error/`` and a ``README.md`` that lists
the equivalent single commands and the headline tables. On Ctrl-C the sections
finished so far (and the interrupted one's results so far) are kept, the
README says where it stopped, and :class:`~attnkit_lab.interrupts.Interrupted`
is raised.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import attnkit

from . import names as names_mod
from . import presets
from .interrupts import Interrupted, is_interrupt
from .progress import status
from .results import RunDir, environment, machine_line


def demo_choices() -> list[names_mod.AttentionChoice]:
    """The default attentions: up to ``DEMO_MAX`` installed ones, in ``DEMO_PREFERENCE`` order first."""
    installed = [c.name for c in names_mod.default_choices()]
    picked = [n for n in presets.DEMO_PREFERENCE if n in installed][:presets.DEMO_MAX]
    for n in installed:
        if len(picked) >= presets.DEMO_MAX:
            break
        if n not in picked:
            picked.append(n)
    return [names_mod.AttentionChoice(n, n) for n in picked]


def _section(title: str) -> None:
    status(f"\n=== {title} ===")


def run_demo(choices: list[names_mod.AttentionChoice], out: RunDir, *, preset: str = "quick", seed: int = 0,
             device: str = "cpu", max_length: int = 8192, show_progress: bool = True) -> dict[str, Any]:
    """Run the three sections into ``out`` (an opened RunDir) and write its README.md."""
    from .bench import BenchSettings, run_bench
    from .error import ErrorSettings, run_error
    from .tasks import MQARTask
    from .train import TrainSettings, run_train

    assert out.tmp is not None
    root = out.tmp
    labels = " ".join(c.label for c in choices)
    timings: dict[str, float] = {}
    commands: list[str] = []
    t_all = time.perf_counter()
    section = ""
    interrupted: BaseException | None = None
    try:
        # 1. bench --------------------------------------------------------------
        section = "bench"
        _section("1/3 bench")
        t0 = time.perf_counter()
        bs = BenchSettings(**presets.bench_presets()[preset])
        bs.lengths = [L for L in bs.lengths if L <= max_length] or [min(bs.lengths)]
        if preset == "quick":
            bs.repeats = 3
        bs = replace(bs, seed=seed, device=device)
        commands.append(f"attnkit bench {labels} --preset {preset} --seed {seed} "
                        f"--lengths {','.join(map(str, bs.lengths))} --repeats {bs.repeats} --out bench")
        with RunDir(root / "bench") as rd:
            run_bench(choices, bs, rd, show_progress=show_progress, preset=preset, strict_build=False)
        timings["bench"] = time.perf_counter() - t0

        # 2. train mqar -----------------------------------------------------------
        section = "train mqar"
        _section("2/3 train mqar")
        t0 = time.perf_counter()
        task_opts, train_opts = presets.TRAIN_PRESETS["mqar"][preset]
        task = MQARTask(**task_opts)
        ts = replace(TrainSettings(**train_opts), seed=seed, device=device)
        if preset == "quick":  # exact attention has solved it by then; keeps the demo within minutes
            ts.steps, ts.warmup = min(ts.steps, 200), min(ts.warmup, 20)
        commands.append(f"attnkit train mqar --attention {labels} --preset {preset} --seed {seed} "
                        f"--steps {ts.steps} --warmup {ts.warmup} --out train-mqar")
        with RunDir(root / "train-mqar") as rd:
            train_payload = run_train(task, choices, ts, rd, show_progress=show_progress, preset=preset)
        timings["train mqar"] = time.perf_counter() - t0

        # 3. error ------------------------------------------------------------------
        section = "error"
        approx = [c for c in choices if not attnkit.get_spec(c.name).exact]
        exact_runs = [r for r in train_payload["runs"]
                      if r["status"] == "ok" and r["checkpoint"] and attnkit.get_spec(r["name"]).exact]
        from_run = str(root / "train-mqar" / Path(exact_runs[0]["checkpoint"]).parent) if exact_runs else None
        if approx:
            _section("3/3 error")
            t0 = time.perf_counter()
            es = ErrorSettings(**presets.error_presets()[preset])
            if preset == "quick":
                es.trials = 2
            es = replace(es, seed=seed, device=device)
            commands.append(f"attnkit error {' '.join(c.label for c in approx)} --preset {preset} --seed {seed} "
                            f"--trials {es.trials}" + (" --from-run train-mqar" if from_run else "") + " --out error")
            with RunDir(root / "error") as rd:
                run_error(approx, es, rd, from_run=from_run, show_progress=show_progress, preset=preset,
                          from_run_label="train-mqar" if from_run else None, budget_hint=False)
            timings["error"] = time.perf_counter() - t0
        else:
            status("3/3 error: skipped (no approximate mechanism among the demo's attentions)")
    except BaseException as e:
        if not is_interrupt(e):
            raise
        interrupted = e

    timings["total"] = time.perf_counter() - t_all
    write_readme(root, choices, preset=preset, seed=seed, device=device, timings=timings, commands=commands,
                 interrupted=section if interrupted is not None else None)
    if interrupted is not None:
        raise Interrupted(f"demo, {section}") from interrupted
    status(f"\ndemo finished in {timings['total']:.0f} s")
    return {"timings": timings}


def write_readme(root: Path, choices: list[names_mod.AttentionChoice], *, preset: str, seed: int, device: str,
                 timings: dict[str, float], commands: list[str], interrupted: str | None = None) -> Path:
    """The demo's README.md: machine, commands, and every finished section's tables."""
    labels = " ".join(c.label for c in choices)
    env = environment(device)
    lines = ["# attnkit demo", ""]
    if interrupted:
        lines += [f"**Interrupted** (Ctrl-C) during {interrupted}: the sections below hold the results so far.", ""]
    lines += [
        f"Machine: {machine_line(env)}",
        "",
        f"Attentions: {labels}; preset `{preset}`, seed {seed}.",
        "",
        "Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
        "",
        "The same results, one command at a time:",
        "",
        "```",
        *commands,
        "```",
        "",
    ]
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
    path = root / "README.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
