"""``attnkit train TASK --attention NAME...``: one small model per attention.

Every attention is trained in the same :class:`~attnkit_lab.models.LabModel`
with the same seed, the same data stream (each run restarts the task's
generator from the seed) and the same optimiser schedule: AdamW, linear
warm-up then cosine decay, gradient clipping at 1. The evaluation set is
drawn once from a stream seeded apart from training.

Reported per attention: the task metric on the evaluation set (accuracy on
scored positions; validation loss and perplexity for ``lm``), training
tokens per second (model step only: forward, backward, optimiser; data
generation and evaluation excluded), the peak memory of one training step
(see :mod:`attnkit_lab.measure`; parameters and optimiser state allocated
before the step are not counted) and the parameter count.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.errors import UsageError

from . import names as names_mod
from .measure import MEMORY_METHOD, peak_memory
from .models import LabModel, ModelConfig
from .progress import Progress, status
from .results import RunDir, environment, fmt_bytes, format_table, machine_line
from .tasks import IGNORE, Batch, Task
from .tasks.listops import ListOpsTask


@dataclass
class TrainSettings:
    """Training hyper-parameters shared by every attention of a run."""

    steps: int = 400
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup: int = 40
    eval_every: int = 50
    eval_batches: int = 4
    dim: int = 64
    depth: int = 2
    heads: int = 2
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    token_shift: bool = False
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"

    def validate(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_batches", "dim", "depth", "heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.dim % self.heads:
            raise UsageError(f"--dim must be a multiple of --heads={self.heads}, got {self.dim}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if self.warmup < 0:
            raise UsageError(f"--warmup must be >= 0, got {self.warmup}")


@dataclass
class RunResult:
    """The outcome of training one attention."""

    label: str
    name: str
    options: dict[str, Any]
    status: str = "ok"          # ok | skipped | diverged | error
    note: str = ""
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    perplexity: float | None = None
    best_accuracy: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_bytes: int | None = None
    params: int | None = None
    wall_s: float | None = None
    curve: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None


def safe_label(label: str) -> str:
    """A file-system-safe directory name for a label."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", label).strip("_") or "run"


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warm-up to ``lr``, then cosine decay to 0 at ``steps``."""
    if settings.warmup and step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    span = max(1, settings.steps - settings.warmup)
    t = min(1.0, (step - settings.warmup) / span)
    return settings.lr * 0.5 * (1 + math.cos(math.pi * t))


def loss_and_counts(model: LabModel, batch: Batch, task: Task) -> tuple[torch.Tensor, int, int]:
    """Mean loss over scored positions, the number scored and the number correct."""
    logits = model(batch.inputs, batch.key_padding_mask)
    if task.kind == "classify":
        loss = F.cross_entropy(logits.float(), batch.targets)
        correct = int((logits.argmax(-1) == batch.targets).sum())
        return loss, batch.targets.numel(), correct
    flat_t = batch.targets.reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1])
    scored = flat_t != IGNORE
    loss = F.cross_entropy(flat[scored].float(), flat_t[scored])
    correct = int((flat[scored].argmax(-1) == flat_t[scored]).sum())
    return loss, int(scored.sum()), correct


@torch.no_grad()
def evaluate(model: LabModel, batches: list[Batch], task: Task, device: torch.device) -> dict[str, float]:
    was = model.training
    model.eval()
    loss_sum = 0.0
    n = correct = 0
    for b in batches:
        b = b.to(device)
        loss, k, c = loss_and_counts(model, b, task)
        loss_sum += float(loss) * k
        n += k
        correct += c
    model.train(was)
    loss = loss_sum / max(n, 1)
    out = {"eval_loss": loss, "eval_accuracy": correct / max(n, 1)}
    if task.metric == "perplexity":
        out["perplexity"] = math.exp(min(loss, 50.0))
    return out


def _record(holder: list[float], fn: Any, *args: Any) -> None:
    holder.append(fn(*args))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train_one(task: Task, choice: names_mod.AttentionChoice, settings: TrainSettings, eval_set: list[Batch],
              *, out_dir: Path | None = None, show_progress: bool = True) -> RunResult:
    """Train one attention on ``task``; failures are recorded, never raised."""
    res = RunResult(choice.label, choice.name, dict(choice.options))
    device = torch.device(settings.device)
    t_start = time.perf_counter()
    cfg = ModelConfig(
        vocab_size=task.vocab_size, num_outputs=task.num_outputs, max_len=task.seq_len,
        dim=settings.dim, depth=settings.depth, heads=settings.heads, kind=task.kind, causal=task.causal,
        attention=choice.name, attention_options=dict(choice.options),
        mlp_ratio=settings.mlp_ratio, dropout=settings.dropout, token_shift=settings.token_shift,
    )
    try:
        torch.manual_seed(settings.seed)
        model = LabModel(cfg).to(device)
    except Exception as e:  # noqa: BLE001 - recorded per attention
        res.status = "skipped" if names_mod.is_refusal(e) else "error"
        res.note = f"cannot build: {names_mod.describe_error(e)}"
        return res
    res.params = model.num_parameters()
    opt = torch.optim.AdamW(_param_groups(model, settings.weight_decay), lr=settings.lr, betas=(0.9, 0.98))
    stream = task.batches(settings.batch_size, settings.seed)
    step_times: list[float] = []
    tokens = 0
    ema = None
    last_eval: dict[str, float] = {}
    memory_step = 1 if settings.steps > 1 else 0

    def one_step(batch: Batch) -> float:
        loss, _, _ = loss_and_counts(model, batch, task)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        return float(loss.detach())

    model.train()
    desc = f"{task.name} {choice.label}"
    with Progress(settings.steps, desc, enabled=show_progress) as bar:
        for step in range(settings.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, settings)
            batch = next(stream).to(device)
            try:
                if step == memory_step:
                    holder: list[float] = []
                    res.peak_bytes = peak_memory(partial(_record, holder, one_step, batch), device)
                    loss_val = holder[0]
                else:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    loss_val = one_step(batch)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    step_times.append(time.perf_counter() - t0)
                    tokens += batch.num_tokens
            except Exception as e:  # noqa: BLE001 - recorded per attention
                res.status = "skipped" if (step == 0 and names_mod.is_refusal(e)) else "error"
                if names_mod.is_oom(e):
                    res.status = "oom"
                res.note = f"step {step}: {names_mod.describe_error(e)}"
                break
            if not math.isfinite(loss_val):
                res.status, res.note = "diverged", f"non-finite loss at step {step}"
                break
            ema = loss_val if ema is None else 0.9 * ema + 0.1 * loss_val
            if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
                last_eval = evaluate(model, eval_set, task, device)
                point = {"step": step + 1, "train_loss": ema, **last_eval,
                         "tokens": tokens, "elapsed_s": time.perf_counter() - t_start}
                res.curve.append(point)
            post: dict[str, Any] = {"loss": ema}
            if last_eval:
                post["eval"] = last_eval["perplexity" if task.metric == "perplexity" else "eval_accuracy"]
            bar.update(1, **post)
    res.wall_s = time.perf_counter() - t_start
    if step_times:
        total = sum(step_times)
        res.tokens_per_s = tokens / total if total > 0 else None
        res.step_time_s = statistics.median(step_times)
    if last_eval:
        res.eval_loss = last_eval["eval_loss"]
        res.eval_accuracy = last_eval["eval_accuracy"]
        res.perplexity = last_eval.get("perplexity")
        res.best_accuracy = max(p["eval_accuracy"] for p in res.curve)
    if out_dir is not None and res.status == "ok":
        d = out_dir / safe_label(choice.label)
        d.mkdir(parents=True, exist_ok=True)
        torch.save({
            "format": "attnkit-lab-checkpoint/1",
            "label": choice.label,
            "model": cfg.as_dict(),
            "task": {"name": task.name, "options": task.options()},
            "settings": asdict(settings),
            "state_dict": model.state_dict(),
        }, d / "checkpoint.pt")
        res.checkpoint = f"{d.name}/checkpoint.pt"
    return res


# ---------------------------------------------------------------- reporting
def result_rows(task: Task, results: list[RunResult]) -> tuple[list[str], list[list[Any]]]:
    if task.metric == "perplexity":
        headers = ["attention", "status", "val loss", "val ppl", "tokens/s", "peak step mem", "params", "time"]
    else:
        headers = ["attention", "status", "accuracy", "best acc", "eval loss", "tokens/s", "peak step mem",
                   "params", "time"]
    rows = []
    for r in results:
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else None
        wall = f"{r.wall_s:.0f} s" if r.wall_s is not None else None
        status_cell = r.status if r.status == "ok" else f"{r.status}: {r.note}"[:70]
        mem = fmt_bytes(r.peak_bytes) if r.peak_bytes is not None else None
        if task.metric == "perplexity":
            rows.append([r.label, status_cell, r.eval_loss, r.perplexity, tps, mem, r.params, wall])
        else:
            rows.append([r.label, status_cell, r.eval_accuracy, r.best_accuracy, r.eval_loss, tps, mem, r.params,
                         wall])
    return headers, rows


def plot_curves(path: Path, task: Task, results: list[RunResult], title: str) -> None:
    from .plotting import learning_curves

    learning_curves(path, task, results, title)


def run_train(task: Task, choices: list[names_mod.AttentionChoice], settings: TrainSettings, out: RunDir, *,
              show_progress: bool = True, preset: str | None = None, extra_config: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Train every choice on ``task`` and write the results into ``out`` (an opened RunDir)."""
    settings.validate()
    device = torch.device(settings.device)
    eval_set = task.eval_batches(settings.batch_size, settings.eval_batches, settings.seed + 1_000_003)
    info = dict(task.extra_info())
    if isinstance(task, ListOpsTask):
        label, frac = ListOpsTask.majority_floor(eval_set)
        info["majority_class"] = label
        info["majority_floor"] = frac
        print(f"listops: majority-class floor on the evaluation set: {frac:.3f} (always answering {label})")
    results = []
    assert out.tmp is not None
    for choice in choices:
        r = train_one(task, choice, settings, eval_set, out_dir=out.tmp, show_progress=show_progress)
        if r.status != "ok":
            status(f"{task.name} {choice.label}: {r.status}: {r.note}", enabled=True)
        results.append(r)
    env = environment(str(device))
    headers, rows = result_rows(task, results)
    table = format_table(rows, headers, align="ll" + "r" * (len(headers) - 2))
    floor = ""
    if "majority_floor" in info:
        floor = f"\nMajority-class floor: {info['majority_floor']:.3f}\n"
    steps_line = (f"{task.name}: {settings.steps} steps × batch {settings.batch_size} × length {task.seq_len}, "
                  f"dim {settings.dim}, depth {settings.depth}, heads {settings.heads}, seed {settings.seed}")
    md = (f"# attnkit train {task.name}\n\n{steps_line}\n\nMachine: {machine_line(env)}\n\n"
          f"Command: `{env['command']}`\n{floor}\n{table}\n")
    payload = {
        "command": "train",
        "task": {"name": task.name, "summary": task.summary, "options": task.options(), "info": info},
        "preset": preset,
        "settings": asdict(settings),
        "memory_method": MEMORY_METHOD.get(device.type, ""),
        "environment": env,
        "config": extra_config or {},
        "runs": [asdict(r) for r in results],
    }
    out.write_json("results.json", payload)
    flat = [{k: v for k, v in asdict(r).items() if k not in ("curve",)} for r in results]
    out.write_csv("results.csv", flat)
    curve_rows = [{"attention": r.label, **p} for r in results for p in r.curve]
    out.write_csv("curves.csv", curve_rows)
    out.write_text("table.md", md)
    title = f"{task.name}: {steps_line.split(': ', 1)[1]}"
    if any(r.curve for r in results):
        plot_curves(out.file("learning_curves.png"), task, results, title)
    print(f"\n{steps_line}\n{floor}{table}")
    return payload
