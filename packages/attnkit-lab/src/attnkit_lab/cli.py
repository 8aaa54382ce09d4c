"""argparse ``configure``/``run`` pairs for ``attnkit bench``, ``error``, ``train`` and ``demo``.

Options left unset take the value of ``--preset`` (``quick``: the CPU demo
sizes; ``paper``: the sizes of the published setups). User mistakes raise
:class:`attnkit.errors.UsageError`; the attnkit CLI prints them without a
traceback and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from attnkit.errors import UsageError

from . import names as names_mod
from .results import RunDir, default_out_dir

PRESETS = ("quick", "paper")


# ----------------------------------------------------------------- parsing
def parse_int(text: str, *, option: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise UsageError(f"{option}: expected a positive integer such as 512, 4K or 1M, got {text!r}")
    value = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
    if value != int(value) or value < 1:
        raise UsageError(f"{option}: expected a positive integer, got {text!r}")
    return int(value)


def parse_int_list(text: str, *, option: str) -> list[int]:
    """``256,512,1K`` or a doubling range ``256..8K``."""
    out: list[int] = []
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        if ".." in part:
            lo_s, _, hi_s = part.partition("..")
            lo, hi = parse_int(lo_s, option=option), parse_int(hi_s, option=option)
            if hi < lo:
                raise UsageError(f"{option}: range {part!r} runs backwards")
            v = lo
            while v <= hi:
                out.append(v)
                v *= 2
        else:
            out.append(parse_int(part, option=option))
    if not out:
        raise UsageError(f"{option}: expected at least one value, got {text!r}")
    return sorted(dict.fromkeys(out))


def parse_float_list(text: str, *, option: str) -> list[float]:
    try:
        vals = [float(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    except ValueError:
        raise UsageError(f"{option}: expected comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise UsageError(f"{option}: expected positive numbers, got {text!r}")
    return vals


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


def _positive(value: Any, option: str, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{option} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def add_common(p: argparse.ArgumentParser, *, out_help: str) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--preset", choices=PRESETS, default="quick",
                   help="sizes: quick (CPU demo, minutes) or paper (the published setups); default quick")
    g.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    g.add_argument("--out", metavar="DIR", default=None, help=out_help)
    g.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    g.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    g.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def _prepare(args: argparse.Namespace, command: str) -> RunDir:
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    args.device = check_device(args.device or "cpu")
    out = RunDir(args.out or default_out_dir(command), force=args.force)
    return out.open()


def _finish(out: RunDir, files: list[str]) -> Path:
    path = out.commit()
    present = [f for f in files if (path / f).exists()]
    print(f"\nresults: {path}" + (f" ({', '.join(present)})" if present else ""))
    return path


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


# ------------------------------------------------------------------- bench
def bench_presets() -> dict[str, dict[str, Any]]:
    return {
        "quick": dict(lengths=[256, 512, 1024, 2048, 4096, 8192], batch=1, heads=4, head_dim=64, repeats=5,
                      warmup=1, time_limit=10.0),
        # a fuller sweep for a real machine: 8 heads of 64 (d_model 512), up to 32K tokens
        "paper": dict(lengths=[512, 1024, 2048, 4096, 8192, 16384, 32768], batch=4, heads=8, head_dim=64,
                      repeats=20, warmup=3, time_limit=60.0),
    }


def configure_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="attention names, optionally with options: performer@num_features=128 "
                        "(default: every installed mechanism's default configuration)")
    g = p.add_argument_group("what to measure")
    g.add_argument("--lengths", default=None, help="sequence lengths: 256,1K,4K or a doubling range 256..8K")
    g.add_argument("--batch", type=int, default=None, help="batch size B")
    g.add_argument("--heads", type=int, default=None, help="heads H")
    g.add_argument("--head-dim", type=int, default=None, help="head dimension D")
    g.add_argument("--dtype", choices=["float32", "float64", "float16", "bfloat16"], default="float32")
    g.add_argument("--causal", action="store_true", help="causal attention (default: non-causal)")
    g.add_argument("--repeats", type=int, default=None, help="timed repetitions (medians are reported)")
    g.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (>= 1)")
    g.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="a first call slower than this is recorded as a timeout and longer lengths are skipped")
    g.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both (default)")
    g.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    add_common(p, out_help="results directory (default attnkit-runs/bench-<time>)")


def bench_settings(args: argparse.Namespace) -> Any:
    from .bench import MODES, BenchSettings

    preset = bench_presets()[args.preset]
    s = BenchSettings(**{k: v for k, v in preset.items()})
    if args.lengths is not None:
        s.lengths = parse_int_list(args.lengths, option="--lengths")
    for name in ("batch", "heads", "head_dim", "repeats", "warmup", "time_limit"):
        v = getattr(args, name)
        if v is not None:
            _positive(v, "--" + name.replace("_", "-"))
            setattr(s, name, v)
    modes = tuple(m for m in re.split(r"[,\s]+", args.modes) if m)
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise UsageError(f"--modes: expected fwd and/or fwdbwd, got {args.modes!r}")
    s.modes = modes
    s.dtype, s.device, s.causal, s.seed = args.dtype, args.device, args.causal, args.seed
    s.memory = not args.no_memory
    return s


def run_bench_cmd(args: argparse.Namespace) -> int:
    from .bench import run_bench

    choices, explicit = _choices(args.names, option="NAME")
    out = _prepare(args, "bench")
    try:
        settings = bench_settings(args)
        run_bench(choices, settings, out, show_progress=not args.quiet, preset=args.preset, strict_build=explicit)
    except BaseException:
        out.abort()
        raise
    _finish(out, ["table.md", "results.json", "results.csv", "bench.png"])
    return 0


# ------------------------------------------------------------------- error
def error_presets() -> dict[str, dict[str, Any]]:
    return {
        # T = 8: small-norm q/k, where random features estimate softmax well; T = 0.5: sharp attention
        "quick": dict(lengths=[256, 1024, 4096], budgets=[16, 64, 256], budget_length=1024,
                      temperatures=[8.0, 2.0, 0.5], trials=3, batch=1, heads=2, head_dim=64,
                      weights_max_length=1024),
        # Performer's approximation study (Choromanski et al., 2021) uses feature counts up to 2·D log D
        "paper": dict(lengths=[512, 1024, 2048, 4096, 8192, 16384], budgets=[16, 32, 64, 128, 256, 512, 1024],
                      budget_length=4096, temperatures=[16.0, 8.0, 4.0, 2.0, 1.0, 0.5], trials=10, batch=1, heads=8,
                      head_dim=64, weights_max_length=2048),
    }


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
                   help="longest L for the attention-weights error (costs L×L memory)")
    add_common(p, out_help="results directory (default attnkit-runs/error-<time>)")


def error_settings(args: argparse.Namespace) -> Any:
    from .error import ErrorSettings

    s = ErrorSettings(**error_presets()[args.preset])
    if args.lengths is not None:
        s.lengths = parse_int_list(args.lengths, option="--lengths")
    if args.budgets is not None:
        s.budgets = parse_int_list(args.budgets, option="--budgets")
    if args.budget_length is not None:
        s.budget_length = parse_int(args.budget_length, option="--budget-length")
    if args.weights_max_length is not None:
        s.weights_max_length = parse_int(args.weights_max_length, option="--weights-max-length")
    if args.temperatures is not None:
        s.temperatures = parse_float_list(args.temperatures, option="--temperatures")
    for name in ("trials", "batch", "heads", "head_dim"):
        v = getattr(args, name)
        if v is not None:
            _positive(v, "--" + name.replace("_", "-"))
            setattr(s, name, v)
    s.budget_option = args.budget_option
    s.dtype, s.device, s.causal, s.seed = args.dtype, args.device, args.causal, args.seed
    return s


def run_error_cmd(args: argparse.Namespace) -> int:
    from .error import run_error

    choices, _ = _choices(args.names, option="NAME", exact=False)
    if args.from_run is not None and not Path(args.from_run).exists():
        raise UsageError(f"--from-run {args.from_run!r}: no such file or directory")
    out = _prepare(args, "error")
    try:
        run_error(choices, error_settings(args), out, from_run=args.from_run, show_progress=not args.quiet,
                  preset=args.preset)
    except BaseException:
        out.abort()
        raise
    _finish(out, ["table.md", "results.json", "results.csv", "error.png"])
    return 0


# ------------------------------------------------------------------- train
# Per task: (task options, training settings) for each preset.
TRAIN_PRESETS: dict[str, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {
    "mqar": {
        # 16 pairs in 64 tokens: exact attention solves it in ~150 steps; elu linear attention
        # (32 features per head) does not, DPFP features (64, 128) close the gap
        "quick": (dict(seq_len=64, vocab=128, num_kv_pairs=16),
                  dict(steps=300, batch_size=64, lr=3e-3, warmup=30, eval_every=25, eval_batches=4,
                       dim=64, depth=2, heads=2, token_shift=True)),
        # Zoology (Arora et al., 2023), Figure 2: V=8192, (L, N) = (256, 16), d_model 128, 2 layers,
        # 1 head, dropout 0.1, batch 256, 100k examples x 64 epochs = 25k steps, 3k test examples
        "paper": (dict(seq_len=256, vocab=8192, num_kv_pairs=16),
                  dict(steps=25_000, batch_size=256, lr=1e-3, warmup=1000, eval_every=1000, eval_batches=12,
                       dim=128, depth=2, heads=1, dropout=0.1)),
    },
    "listops": {
        "quick": (dict(max_depth=6, max_args=5, min_length=16, max_length=128),
                  dict(steps=400, batch_size=32, lr=1e-3, warmup=40, eval_every=50, eval_batches=8,
                       dim=64, depth=2, heads=2)),
        # LRA (Tay et al., 2021): depth 10, 10 args, lengths 500-2000; 6 layers, d 512, 8 heads, MLP 2048,
        # batch 32, 5000 steps, warm-up 1000, weight decay 0.1
        "paper": (dict(max_depth=10, max_args=10, min_length=500, max_length=2000),
                  dict(steps=5000, batch_size=32, lr=1e-3, warmup=1000, eval_every=250, eval_batches=63,
                       dim=512, depth=6, heads=8, mlp_ratio=4.0)),
    },
    "copy": {
        "quick": (dict(seq_len=64, vocab=16),
                  dict(steps=400, batch_size=32, lr=3e-3, warmup=40, eval_every=50, eval_batches=4,
                       dim=64, depth=2, heads=2, token_shift=True)),
        # Reformer (Kitaev et al., 2020) §5: 0w0w with |w| = 511 (L = 1024), symbols 1..127,
        # a 1-layer model with d_model 256 and 4 heads, 150k steps
        "paper": (dict(seq_len=1024, vocab=128),
                  dict(steps=150_000, batch_size=16, lr=1e-3, warmup=1000, eval_every=5000, eval_batches=8,
                       dim=256, depth=1, heads=4)),
    },
    "lm": {
        "quick": (dict(seq_len=128, vocab=1024, corpus_chars=2_000_000),
                  dict(steps=200, batch_size=8, lr=3e-3, warmup=20, eval_every=25, eval_batches=8,
                       dim=128, depth=2, heads=4)),
        # no published setup exists for this corpus: a GPT-style small model on the whole stdlib
        "paper": (dict(seq_len=512, vocab=8192, corpus_chars=100_000_000),
                  dict(steps=20_000, batch_size=32, lr=6e-4, warmup=1000, eval_every=1000, eval_batches=32,
                       dim=512, depth=6, heads=8, dropout=0.1)),
    },
}

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


def configure_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", metavar="TASK", help="mqar, listops, copy or lm")
    p.add_argument("--attention", "-a", nargs="+", metavar="NAME", default=None,
                   help="attentions to train, optionally NAME@option=value (default: every installed one)")
    g = p.add_argument_group("model and optimisation (default: the preset's)")
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=None)
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW, warm-up then cosine)")
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--warmup", type=int, default=None, help="warm-up steps")
    g.add_argument("--eval-every", type=int, default=None, help="steps between evaluations")
    g.add_argument("--eval-batches", type=int, default=None, help="evaluation set size in batches")
    g.add_argument("--dim", type=int, default=None, help="model width")
    g.add_argument("--depth", type=int, default=None, help="Transformer blocks")
    g.add_argument("--heads", type=int, default=None, help="attention heads")
    g.add_argument("--mlp-ratio", type=float, default=None)
    g.add_argument("--dropout", type=float, default=None)
    g.add_argument("--token-shift", action=argparse.BooleanOptionalAction, default=None,
                   help="add a learned projection of the previous token's embedding (a width-2 causal "
                        "convolution; the quick mqar and copy presets use it)")
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
    t.add_argument("--cache-dir", default=None, help="lm: tokenizer cache (default ~/.cache/attnkit)")
    add_common(p, out_help="results directory (default attnkit-runs/train-TASK-<time>)")


def build_task(args: argparse.Namespace, *, log: Any = None) -> Any:
    from .tasks import task_class

    cls = task_class(args.task)
    task_opts = dict(TRAIN_PRESETS[cls.name][args.preset][0])
    for flag, (attr, tasks) in TASK_OPTIONS.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if cls.name not in tasks:
            raise UsageError(f"{flag} applies to {', '.join(tasks)}, not to {cls.name}")
        task_opts[attr] = tuple(value) if attr == "text" else value
    if cls.name == "lm":
        task_opts["log"] = log
    return cls(**task_opts)


def train_settings(args: argparse.Namespace, task_name: str) -> Any:
    from .train import TrainSettings

    s = TrainSettings(**TRAIN_PRESETS[task_name][args.preset][1])
    for f in fields(s):
        if f.name in ("seed", "device", "grad_clip"):
            continue
        v = getattr(args, f.name, None)
        if v is not None:
            setattr(s, f.name, v)
    for name in ("weight_decay", "dropout"):
        _positive(getattr(s, name), "--" + name.replace("_", "-"), allow_zero=True)
    _positive(s.mlp_ratio, "--mlp-ratio")
    s = replace(s, seed=args.seed, device=args.device)
    s.validate()
    return s


def run_train_cmd(args: argparse.Namespace) -> int:
    from .progress import status
    from .tasks import task_class
    from .train import run_train

    task_name = task_class(args.task).name          # unknown task: a usage error before anything else
    choices, _ = _choices(args.attention, option="--attention")
    args.device = check_device(args.device or "cpu")
    settings = train_settings(args, task_name)
    out = _prepare(args, f"train-{task_name}")
    try:
        task = build_task(args, log=lambda m: status(m, enabled=not args.quiet))
        run_train(task, choices, settings, out, show_progress=not args.quiet, preset=args.preset)
    except BaseException:
        out.abort()
        raise
    _finish(out, ["table.md", "results.json", "results.csv", "curves.csv", "learning_curves.png"])
    return 0


# -------------------------------------------------------------------- demo
DEMO_PREFERENCE = ("softmax", "linear", "performer", "nystrom", "linformer", "sliding-window", "local", "rfa")
DEMO_MAX = 3


def configure_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", "-a", nargs="+", metavar="NAME", default=None,
                   help="attentions to include (default: up to three installed ones, exact softmax first)")
    p.add_argument("--bench-max-length", default="8K", help="longest bench length (default 8K)")
    add_common(p, out_help="results directory (default attnkit-runs/demo-<time>)")


def demo_choices(texts: list[str] | None) -> list[names_mod.AttentionChoice]:
    if texts:
        return _choices(texts, option="--attention")[0]
    installed = [c.name for c in names_mod.default_choices()]
    picked = [n for n in DEMO_PREFERENCE if n in installed][:DEMO_MAX]
    for n in installed:
        if len(picked) >= DEMO_MAX:
            break
        if n not in picked:
            picked.append(n)
    return [names_mod.AttentionChoice(n, n) for n in picked]


def run_demo_cmd(args: argparse.Namespace) -> int:
    from .demo import run_demo

    choices = demo_choices(args.attention)
    max_len = parse_int(args.bench_max_length, option="--bench-max-length")
    out = _prepare(args, "demo")
    try:
        run_demo(choices, out, preset=args.preset, seed=args.seed, device=args.device, max_length=max_len,
                 show_progress=not args.quiet)
    except BaseException:
        out.abort()
        raise
    path = out.commit()
    print(f"\ndemo results: {path}")
    for f in ("README.md", "bench/table.md", "bench/bench.png", "train-mqar/table.md",
              "train-mqar/learning_curves.png", "error/table.md", "error/error.png"):
        if (path / f).exists():
            print(f"  {path / f}")
    return 0
