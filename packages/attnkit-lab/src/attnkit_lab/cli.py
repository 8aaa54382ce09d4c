"""argparse ``configure``/``run`` pairs for ``attnkit bench``, ``error``, ``train`` and ``demo``.

Options left unset take the value of ``--preset`` (:mod:`attnkit_lab.presets`;
``quick``: the CPU demo sizes, ``paper``: the sizes of the published setups).
Every value is range-checked before any work starts (:mod:`attnkit_lab.options`).
User mistakes raise :class:`attnkit.errors.UsageError`; the attnkit CLI prints
them without a traceback and exits with status 2.

Ctrl-C (also when numba reports it as a ``SystemError``) stops a command at
once: the results measured so far are published in the run directory, its
path is printed and the command exits with status 130
(:mod:`attnkit_lab.interrupts`).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from attnkit.errors import UsageError

from . import names as names_mod
from . import presets
from .interrupts import is_interrupt
from .options import (
    MAX_LENGTH,
    MAX_SIZE,
    MAX_THREADS,
    check_float,
    check_int,
    check_seed,
    parse_float_list,
    parse_int,
    parse_int_list,
)
from .presets import PRESETS
from .results import RunDir, default_out_dir

__all__ = [
    "configure_bench", "configure_demo", "configure_error", "configure_train",
    "run_bench_cmd", "run_demo_cmd", "run_error_cmd", "run_train_cmd",
    "parse_float_list", "parse_int", "parse_int_list",
]


def check_device(device: str) -> str:
    try:
        d = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: expected cpu or cuda[:N], got {device!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available in this PyTorch ({torch.__version__})")
    if d.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu or cuda[:N], got {device!r}")
    return device


def add_common(p: argparse.ArgumentParser, *, out_help: str) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--preset", choices=PRESETS, default="quick",
                   help="sizes: quick (CPU demo, minutes) or paper (the published setups); default quick")
    g.add_argument("--seed", type=int, default=0, help="seed of every random choice, 0 to 2**32 - 1 (default 0)")
    g.add_argument("--out", metavar="DIR", default=None, help=out_help)
    g.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    g.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    g.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def _check_common(args: argparse.Namespace) -> None:
    """The options every command takes; before any work."""
    check_seed(args.seed)
    if args.threads is not None:
        check_int(args.threads, "--threads", lo=1, hi=MAX_THREADS)
    args.device = check_device(args.device or "cpu")


def _open(args: argparse.Namespace, command: str) -> RunDir:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return RunDir(args.out or default_out_dir(command), force=args.force).open()


Command = Callable[[argparse.Namespace], int]


def _interruptible(command: str) -> Callable[[Command], Command]:
    """An interrupt outside a run directory's life (numba's SystemError included): status 130."""
    def deco(fn: Command) -> Command:
        @functools.wraps(fn)
        def run(args: argparse.Namespace) -> int:
            try:
                return fn(args)
            except BaseException as e:
                if not is_interrupt(e):
                    raise
                print(f"\nattnkit {command}: interrupted", file=sys.stderr)
                return 130
        return run
    return deco


def _run_in(out: RunDir, command: str, files: list[str], body: Callable[[], Any]) -> int:
    """Run ``body`` writing into the opened ``out``; publish it when done or interrupted.

    Any other exception removes the partial directory and propagates.
    """
    try:
        body()
    except BaseException as e:
        if is_interrupt(e):
            return _interrupted(out, command, files)
        out.abort()
        raise
    path = out.commit()
    present = [f for f in files if (path / f).exists()]
    print(f"\nresults: {path}" + (f" ({', '.join(present)})" if present else ""))
    return 0


def _interrupted(out: RunDir, command: str, files: list[str]) -> int:
    if out.tmp is not None and any(out.tmp.iterdir()):
        path = out.commit()
        present = [f for f in files if (path / f).exists()]
        print(f"\nattnkit {command}: interrupted; results so far: {path}"
              + (f" ({', '.join(present)})" if present else ""), file=sys.stderr)
    else:
        out.abort()
        print(f"\nattnkit {command}: interrupted before any result was written", file=sys.stderr)
    return 130


def _choices(texts: list[str] | None, *, option: str,
             exact: bool | None = None) -> tuple[list[names_mod.AttentionChoice], bool]:
    """Parsed choices and whether they were given explicitly."""
    if texts:
        choices = [names_mod.parse_choice(t, option=option) for t in texts]
        names_mod.check_choices(choices, option=option)
        return choices, True
    choices = names_mod.default_choices(exact=exact)
    if not choices:
        what = "approximate attention" if exact is False else "attention"
        raise UsageError(f"no {what} is installed; install a plugin (e.g. `pip install attnkit-kernelized`) "
                         "or name one")
    return choices, False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------- bench
def configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="attention names, optionally with options: performer@num_features=128 "
                        "(default: every installed mechanism's default configuration)")
    g = p.add_argument_group("what to measure")
    g.add_argument("--lengths", default=None,
                   help="sequence lengths: 256,1K,4K or a doubling range 256..8K (at most 16M = 2**24)")
    g.add_argument("--batch", type=int, default=None, help="batch size B")
    g.add_argument("--heads", type=int, default=None, help="heads H")
    g.add_argument("--head-dim", type=int, default=None, help="head dimension D")
    g.add_argument("--dtype", choices=["float32", "float64", "float16", "bfloat16"], default="float32")
    g.add_argument("--causal", action="store_true", help="causal attention (default: non-causal)")
    g.add_argument("--repeats", type=int, default=None,
                   help="timed rounds (the median is reported, with min, quartiles and max)")
    g.add_argument("--warmup", type=int, default=None,
                   help="untimed warm-up calls of every implementation at every length and mode, after its "
                        "first call and right before it is timed (>= 1)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="a first call and a second call both slower than this are recorded as a timeout, "
                        "and longer lengths are skipped")
    g.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both (default)")
    g.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    add_common(p, out_help="results directory (default attnkit-runs/bench-<time>)")


def bench_settings(args: argparse.Namespace) -> Any:
    from .bench import MODES, BenchSettings

    s = BenchSettings(**presets.bench_presets()[args.preset])
    if args.lengths is not None:
        s.lengths = parse_int_list(args.lengths, option="--lengths", hi=MAX_LENGTH)
    for name, hi in (("batch", MAX_SIZE), ("heads", MAX_SIZE), ("head_dim", MAX_SIZE), ("repeats", None),
                     ("warmup", None)):
        v = getattr(args, name)
        if v is not None:
            setattr(s, name, check_int(v, _flag(name), lo=1, hi=hi))
    if args.time_limit is not None:
        s.time_limit = check_float(args.time_limit, "--time-limit", lo=0, lo_open=True)
    modes = tuple(m for m in re.split(r"[,\s]+", args.modes) if m)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"--modes: expected fwd and/or fwdbwd, got {args.modes!r}")
    s.modes = tuple(dict.fromkeys(modes))
    s.dtype, s.device, s.causal, s.seed = args.dtype, args.device, args.causal, args.seed
    s.memory = not args.no_memory
    return s


@_interruptible("bench")
def run_bench_cmd(args: argparse.Namespace) -> int:
    from .bench import run_bench

    _check_common(args)
    choices, explicit = _choices(args.names, option="NAME")
    settings = bench_settings(args)
    out = _open(args, "bench")
    return _run_in(out, "bench", ["table.md", "results.json", "results.csv", "bench.png"],
                   lambda: run_bench(choices, settings, out, show_progress=not args.quiet, preset=args.preset,
                                     strict_build=explicit))


# ------------------------------------------------------------------- error
def configure_error(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="approximate attention names, optionally NAME@option=value "
                        "(default: every installed non-exact mechanism)")
    g = p.add_argument_group("what to measure")
    g.add_argument("--lengths", default=None, help="lengths of the length sweep: 256,1K,4K or 256..4K")
    g.add_argument("--budgets", default=None, help="budget values of the budget sweep, e.g. 16,64,256")
    g.add_argument("--budget-length", default=None, help="length L of the budget sweep")
    g.add_argument("--budget-option", default=None, metavar="OPTION",
                   help="the option that sets the budget (default: found from each spec's options, "
                        "e.g. num_features, num_landmarks, rank, window)")
    g.add_argument("--temperatures", default=None,
                   help="Gaussian input temperatures T: q, k ~ N(0, 1/T), logit std 1/T (quick: 8,2,0.5)")
    g.add_argument("--from-run", default=None, metavar="DIR",
                   help="also use q/k/v captured from a model trained by `attnkit train` (its output directory)")
    g.add_argument("--trials", type=int, default=None, help="trials averaged per point (new inputs and features)")
    g.add_argument("--batch", type=int, default=None, help="batch size B of Gaussian inputs")
    g.add_argument("--heads", type=int, default=None, help="heads H of Gaussian inputs")
    g.add_argument("--head-dim", type=int, default=None, help="head dimension D of Gaussian inputs")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="dtype the mechanism runs in (the reference is float64)")
    g.add_argument("--causal", action="store_true", help="causal attention (Gaussian inputs)")
    g.add_argument("--weights-max-length", default=None,
                   help="longest L for the attention-weights error (costs L×L memory; 0: never)")
    add_common(p, out_help="results directory (default attnkit-runs/error-<time>)")


def error_settings(args: argparse.Namespace) -> Any:
    from .error import ErrorSettings

    s = ErrorSettings(**presets.error_presets()[args.preset])
    if args.lengths is not None:
        s.lengths = parse_int_list(args.lengths, option="--lengths", hi=MAX_LENGTH)
    if args.budgets is not None:
        s.budgets = parse_int_list(args.budgets, option="--budgets", hi=MAX_LENGTH)
    if args.budget_length is not None:
        s.budget_length = parse_int(args.budget_length, option="--budget-length", hi=MAX_LENGTH)
    if args.weights_max_length is not None:
        s.weights_max_length = parse_int(args.weights_max_length, option="--weights-max-length", lo=0,
                                         hi=MAX_LENGTH)
    if args.temperatures is not None:
        s.temperatures = parse_float_list(args.temperatures, option="--temperatures")
    for name, hi in (("trials", None), ("batch", MAX_SIZE), ("heads", MAX_SIZE), ("head_dim", MAX_SIZE)):
        v = getattr(args, name)
        if v is not None:
            setattr(s, name, check_int(v, _flag(name), lo=1, hi=hi))
    s.budget_option = args.budget_option
    s.dtype, s.device, s.causal, s.seed = args.dtype, args.device, args.causal, args.seed
    return s


@_interruptible("error")
def run_error_cmd(args: argparse.Namespace) -> int:
    from .error import run_error

    _check_common(args)
    choices, _ = _choices(args.names, option="NAME", exact=False)
    if args.from_run is not None and not Path(args.from_run).exists():
        raise UsageError(f"--from-run {args.from_run!r}: no such file or directory")
    settings = error_settings(args)
    out = _open(args, "error")
    return _run_in(out, "error", ["table.md", "results.json", "results.csv", "error.png"],
                   lambda: run_error(choices, settings, out, from_run=args.from_run, show_progress=not args.quiet,
                                     preset=args.preset))


# ------------------------------------------------------------------- train
# option -> (attribute, the tasks that take it)
TASK_OPTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "--seq-len": ("seq_len", ("mqar", "copy", "lm")),
    "--vocab": ("vocab", ("mqar", "copy", "lm")),
    "--num-kv-pairs": ("num_kv_pairs", ("mqar",)),
    "--power-a": ("power_a", ("mqar",)),
    "--random-non-queries": ("random_non_queries", ("mqar",)),
    "--max-depth": ("max_depth", ("listops",)),
    "--max-args": ("max_args", ("listops",)),
    "--min-length": ("min_length", ("listops",)),
    "--max-length": ("max_length", ("listops",)),
    "--text": ("text", ("lm",)),
    "--corpus-chars": ("corpus_chars", ("lm",)),
    "--val-fraction": ("val_fraction", ("lm",)),
    "--cache-dir": ("cache_dir", ("lm",)),
}

# Ranges of the numeric task options, checked before the task is built (each task
# then checks how its options fit together, e.g. mqar's --seq-len >= 4 x --num-kv-pairs).
# int options: (lo, hi); float options: check_float keyword arguments.
TASK_INT_RANGES: dict[str, tuple[int, int | None]] = {
    "seq_len": (1, MAX_LENGTH),
    "vocab": (1, MAX_LENGTH),
    "num_kv_pairs": (1, MAX_LENGTH),
    "max_depth": (1, 100),          # listops trees are generated recursively
    "max_args": (2, MAX_LENGTH),
    "min_length": (0, MAX_LENGTH),
    "max_length": (1, MAX_LENGTH),
    "corpus_chars": (1, None),
}
TASK_FLOAT_RANGES: dict[str, dict[str, Any]] = {
    "power_a": dict(lo=0, hi=1, lo_open=True),
    "val_fraction": dict(lo=0, hi=1, lo_open=True, hi_open=True),
}


def configure_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK", help="mqar, listops, copy or lm")
    p.add_argument("--attention", "-a", nargs="+", metavar="NAME", default=None,
                   help="attentions to train, optionally NAME@option=value (default: every installed one)")
    g = p.add_argument_group("model and optimisation (default: the preset's)")
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=None)
    g.add_argument("--lr", type=float, default=None, help="peak learning rate > 0 (AdamW, warm-up then cosine)")
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps")
    g.add_argument("--eval-every", type=int, default=None, help="steps between evaluations")
    g.add_argument("--eval-batches", type=int, default=None, help="evaluation set size in batches")
    g.add_argument("--dim", type=int, default=None, help="model width")
    g.add_argument("--depth", type=int, default=None, help="Transformer blocks")
    g.add_argument("--block", default=None, metavar="NAME",
                   help="registered block, optionally NAME@option=value (default pre-norm; e.g. "
                        "act@max_steps=8 with --depth 1 for a Universal Transformer)")
    g.add_argument("--heads", type=int, default=None, help="attention heads")
    g.add_argument("--mlp-ratio", type=float, default=None)
    g.add_argument("--dropout", type=float, default=None, help="dropout probability in [0, 1)")
    g.add_argument("--token-shift", action=argparse.BooleanOptionalAction, default=None,
                   help="add a learned projection of the previous token's embedding (a width-2 causal "
                        "convolution; the quick mqar and copy presets use it)")
    g.add_argument("--segment", type=int, default=None, metavar="N",
                   help="segment-level training (tokens tasks): feed each window in segments of N tokens, carrying "
                        "the state of 'segment'-streaming attentions (transformer-xl, compressive, ...) across them; "
                        "evaluation reports perplexity with and without memory (default 0: whole windows)")
    t = p.add_argument_group("task options (default: the preset's)")
    t.add_argument("--seq-len", type=int, default=None, help="sequence length (mqar, copy, lm)")
    t.add_argument("--vocab", type=int, default=None, help="vocabulary size (mqar, copy; lm: tokenizer size)")
    t.add_argument("--num-kv-pairs", type=int, default=None, help="mqar: key-value pairs per sequence")
    t.add_argument("--power-a", type=float, default=None, help="mqar: power-law exponent of query gaps")
    t.add_argument("--random-non-queries", action="store_const", const=True, default=None,
                   help="mqar: random tokens instead of 0 between queries")
    t.add_argument("--max-depth", type=int, default=None, help="listops: deepest nesting")
    t.add_argument("--max-args", type=int, default=None, help="listops: most arguments per operator")
    t.add_argument("--min-length", type=int, default=None, help="listops: shortest expression (exclusive)")
    t.add_argument("--max-length", type=int, default=None, help="listops: longest expression (exclusive) = L")
    t.add_argument("--text", nargs="+", metavar="FILE", default=None,
                   help="lm: corpus files (default: the Python standard library's sources)")
    t.add_argument("--corpus-chars", type=int, default=None, help="lm: characters taken from the corpus")
    t.add_argument("--val-fraction", type=float, default=None, help="lm: held-out fraction (default 0.1)")
    t.add_argument("--cache-dir", default=None,
                   help="lm: tokenizer cache (default $ATTNKIT_CACHE_DIR, else the user cache dir: ~/.cache/attnkit)")
    g.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data-parallel training on N CPU processes (torch.distributed.run, gloo): each takes "
                        "--batch-size of every global batch of N x --batch-size; gradients are averaged (default 1)")
    r = p.add_argument_group("checkpoints and resuming")
    r.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="save the training state (model, optimizer, schedule step, RNG states, data position) "
                        "every N steps, atomically, per attention (default: no checkpoints)")
    r.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where the checkpoints go (default: OUT.checkpoints next to --out)")
    r.add_argument("--resume", default=None, metavar="DIR",
                   help="continue a killed run from the checkpoints in DIR (same task, attentions and settings); "
                        "the resumed run ends with the parameters of the uninterrupted one")
    add_common(p, out_help="results directory (default attnkit-runs/train-TASK-<time>)")


def checkpointing(args: argparse.Namespace, out: Path) -> Any:
    """The :class:`~attnkit_lab.checkpoint.Checkpointing` of ``--checkpoint-every/--checkpoint-dir/--resume``."""
    from .checkpoint import Checkpointing

    every = args.checkpoint_every
    if every is not None:
        check_int(every, "--checkpoint-every", lo=1)
    if args.resume is not None:
        d = Path(args.resume)
        if not d.is_dir():
            raise UsageError(f"--resume {args.resume!r}: expected the directory of a run's checkpoints")
        if args.checkpoint_dir is not None and Path(args.checkpoint_dir).absolute() != d.absolute():
            raise UsageError("--checkpoint-dir: a resumed run keeps checkpointing into --resume DIR; "
                             f"got another directory {args.checkpoint_dir!r}")
        return Checkpointing(d, every or 0, resume=True)
    if every is None:
        if args.checkpoint_dir is not None:
            raise UsageError("--checkpoint-dir needs --checkpoint-every N")
        return None
    d = Path(args.checkpoint_dir) if args.checkpoint_dir is not None else out.with_name(out.name + ".checkpoints")
    return Checkpointing(d, every)


def task_options(args: argparse.Namespace) -> tuple[type, dict[str, Any]]:
    """The task class and its options (the preset's, overridden by the flags given), range-checked."""
    from .tasks import task_class

    cls = task_class(args.task)
    task_opts = dict(presets.TRAIN_PRESETS[cls.name][args.preset][0])
    for flag, (attr, tasks) in TASK_OPTIONS.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if cls.name not in tasks:
            raise UsageError(f"{flag} applies to {', '.join(tasks)}, not to {cls.name}")
        task_opts[attr] = tuple(value) if attr == "text" else value
    check_task_options(task_opts)
    return cls, task_opts


def build_task(args: argparse.Namespace, *, log: Any = None) -> Any:
    cls, task_opts = task_options(args)
    if cls.name == "lm":
        task_opts["log"] = log
    return cls(**task_opts)


def check_task_options(task_opts: dict[str, Any]) -> None:
    """Range checks of the numeric task options (usage errors naming the option)."""
    for attr, value in task_opts.items():
        if attr in TASK_INT_RANGES:
            lo, hi = TASK_INT_RANGES[attr]
            check_int(value, _flag(attr), lo=lo, hi=hi)
        elif attr in TASK_FLOAT_RANGES:
            check_float(value, _flag(attr), **TASK_FLOAT_RANGES[attr])


def train_settings(args: argparse.Namespace, task_name: str) -> Any:
    from .train import TrainSettings

    s = TrainSettings(**presets.TRAIN_PRESETS[task_name][args.preset][1])
    for f in fields(s):
        if f.name in ("seed", "device", "grad_clip"):
            continue
        v = getattr(args, f.name, None)
        if v is not None:
            setattr(s, f.name, v)
    s = replace(s, seed=args.seed, device=args.device)
    s.validate()
    return s


def _launch(nproc: int) -> int:
    """Re-run this command line under ``torch.distributed.run`` with ``nproc`` processes; their exit status."""
    import os
    import subprocess

    words, argv = [], sys.argv[1:]
    if "train" not in argv:
        raise UsageError("--nproc: launch from the command line (attnkit train ... --nproc N)")
    skip = False
    for w in argv:  # the workers get the command without --nproc (torch.distributed.run would take it as its own)
        if skip:
            skip = False
        elif w == "--nproc":
            skip = True
        elif not w.startswith("--nproc="):
            words.append(w)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "attnkit", *words]
    return subprocess.call(cmd, env={**os.environ, "ATTNKIT_LAB_NPROC": str(nproc)})


def _join_process_group(args: argparse.Namespace) -> Path | None:
    """Inside ``torch.distributed.run``: join the gloo group; ranks > 0 write their results to a scratch
    directory (returned, to be removed); rank 0 writes ``--out``."""
    import os
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        return None
    scratch = Path(tempfile.mkdtemp(prefix="attnkit-rank"))
    args.out, args.force, args.quiet = str(scratch / "out"), False, True
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 prints the tables; the process ends after the run
    return scratch


@_interruptible("train")
def run_train_cmd(args: argparse.Namespace) -> int:
    import os

    from .progress import status
    from .tasks import task_class
    from .train import run_train

    task_name = task_class(args.task).name          # unknown task: a usage error before anything else
    check_int(args.nproc, "--nproc", lo=1, hi=MAX_THREADS)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _launch(args.nproc)
    launched = "LOCAL_RANK" in os.environ and os.environ.get("ATTNKIT_LAB_NPROC", "1") != "1"
    scratch = _join_process_group(args) if launched else None
    _check_common(args)
    choices, _ = _choices(args.attention, option="--attention")
    settings = train_settings(args, task_name)
    task_options(args)                               # ranges, before the run directory exists
    args.out = args.out or str(default_out_dir(f"train-{task_name}"))  # one name for the run and its checkpoints
    ckpt = checkpointing(args, Path(args.out))
    out = _open(args, f"train-{task_name}")

    def body() -> None:
        task = build_task(args, log=lambda m: status(m, enabled=not args.quiet))
        run_train(task, choices, settings, out, show_progress=not args.quiet, preset=args.preset,
                  checkpointing=ckpt)

    try:
        return _run_in(out, "train", ["table.md", "results.json", "results.csv", "curves.csv",
                                      "learning_curves.png"], body)
    finally:
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)


# -------------------------------------------------------------------- demo
def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", "-a", nargs="+", metavar="NAME", default=None,
                   help="attentions to include (default: up to three installed ones, exact softmax first)")
    p.add_argument("--bench-max-length", default="8K", help="longest bench length (default 8K)")
    add_common(p, out_help="results directory (default attnkit-runs/demo-<time>)")


DEMO_FILES = ("README.md", "bench/table.md", "bench/bench.png", "train-mqar/table.md",
              "train-mqar/learning_curves.png", "error/table.md", "error/error.png")


@_interruptible("demo")
def run_demo_cmd(args: argparse.Namespace) -> int:
    from .demo import demo_choices, run_demo

    _check_common(args)
    choices = _choices(args.attention, option="--attention")[0] if args.attention else demo_choices()
    max_len = parse_int(args.bench_max_length, option="--bench-max-length", hi=MAX_LENGTH)
    out = _open(args, "demo")
    try:
        run_demo(choices, out, preset=args.preset, seed=args.seed, device=args.device, max_length=max_len,
                 show_progress=not args.quiet)
    except BaseException as e:
        if is_interrupt(e):
            return _interrupted(out, "demo", list(DEMO_FILES))
        out.abort()
        raise
    path = out.commit()
    print(f"\ndemo results: {path}")
    for f in DEMO_FILES:
        if (path / f).exists():
            print(f"  {path / f}")
    return 0
