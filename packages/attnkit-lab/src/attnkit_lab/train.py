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

Auxiliary losses: the loss of a training step is the task loss plus
``sum(attnkit.aux_losses(model).values())`` (what the attention modules
recorded in that step's forward, weighted by their specs); each named value
is logged (moving average) in the curve points, the result and the progress
line. Evaluation passes drop what they record (``attnkit.clear_aux_losses``).

Ctrl-C (or numba's ``SystemError`` wrapping it) stops the run at once: the
finished runs and the interrupted one (status ``interrupted``, its curve so
far) are written and :class:`~attnkit_lab.interrupts.Interrupted` is raised.
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

import attnkit
from attnkit.errors import UsageError

from . import names as names_mod
from .checkpoint import FORMAT as STATE_FORMAT
from .checkpoint import Checkpointing, atomic_save, load_state, rng_state, set_rng_state
from .interrupts import Interrupted, is_interrupt, raise_if_interrupt
from .measure import MEMORY_METHOD, peak_memory
from .models import LabModel, ModelConfig, lab_stats
from .options import MAX_SEED, MAX_SIZE, check_float, check_int
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
    segment: int = 0  # 0: whole windows; N > 0: segment-level training (see :func:`loss_and_counts`)
    block: str = "pre-norm"

    def validate(self) -> None:
        """Range checks; a value out of range is a usage error naming its option."""
        for name in ("steps", "eval_every", "eval_batches"):
            check_int(getattr(self, name), _flag(name), lo=1)
        for name in ("batch_size", "dim", "heads"):
            check_int(getattr(self, name), _flag(name), lo=1, hi=MAX_SIZE)
        check_int(self.depth, "--depth", lo=1, hi=1024)
        check_int(self.segment, "--segment", lo=0, hi=MAX_SIZE)
        check_int(self.warmup, "--warmup", lo=0)
        check_float(self.lr, "--lr", lo=0, lo_open=True)
        check_float(self.weight_decay, "--weight-decay", lo=0)
        check_float(self.mlp_ratio, "--mlp-ratio", lo=0, lo_open=True, hi=1024)
        check_float(self.dropout, "--dropout", lo=0, hi=1, hi_open=True)
        check_float(self.grad_clip, "grad_clip", lo=0)
        check_int(self.seed, "--seed", lo=0, hi=MAX_SEED)
        names_mod.parse_choice(self.block, option="--block")
        if self.dim % self.heads:
            raise UsageError(f"--dim: expected a multiple of --heads={self.heads}, got {self.dim}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class RunResult:
    """The outcome of training one attention."""

    label: str
    name: str
    options: dict[str, Any]
    status: str = "ok"          # ok | skipped | diverged | oom | error | interrupted
    note: str = ""
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    perplexity: float | None = None
    perplexity_no_memory: float | None = None
    eval_loss_no_memory: float | None = None
    eval_accuracy_no_memory: float | None = None
    best_accuracy: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    peak_bytes: int | None = None
    params: int | None = None
    wall_s: float | None = None
    curve: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None
    aux_losses: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


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


def segment_logits(model: LabModel, batch: Batch, segment: int, memory: bool) -> torch.Tensor:
    """Logits ``(B, L, V)`` of a window fed in segments of ``segment`` tokens.

    With ``memory`` (and attentions declaring ``"segment"`` streaming) the
    blocks' state is carried from one segment to the next, under autograd in
    training (how far gradients reach back is the mechanism's choice, e.g.
    ``grad_segments``); without, every segment starts fresh. Positions restart
    at 0 in every segment. The last segment may be shorter.
    """
    carry = memory and model.carries_segment_state()
    outs, state = [], None
    kpm = batch.key_padding_mask
    for s in range(0, batch.inputs.shape[1], segment):
        part = None if kpm is None else kpm[:, s:s + segment]
        if carry:
            o, state = model(batch.inputs[:, s:s + segment], part, state=state, return_state=True)
        else:
            o = model(batch.inputs[:, s:s + segment], part)
        outs.append(o)
    return torch.cat(outs, dim=1)


def loss_and_counts(model: LabModel, batch: Batch, task: Task, segment: int = 0,
                    memory: bool = True) -> tuple[torch.Tensor, int, int]:
    """Mean loss over scored positions, the number scored and the number correct.

    ``segment > 0`` (``tokens`` tasks): the window is fed in segments (:func:`segment_logits`).
    """
    if segment and task.kind == "tokens":
        logits = segment_logits(model, batch, segment, memory)
    else:
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
def evaluate(model: LabModel, batches: list[Batch], task: Task, device: torch.device,
             segment: int = 0) -> dict[str, float]:
    """Loss, accuracy (and perplexity for ``lm``) on ``batches``.

    With ``segment > 0``: fed in segments carrying the memory, and again with
    the memory reset at every segment (``eval_loss_no_memory``,
    ``perplexity_no_memory``: the same segment length, no context from
    earlier segments) when the model carries segment state.
    """
    was = model.training
    model.eval()
    modes = [True, False] if segment and task.kind == "tokens" and model.carries_segment_state() else [True]
    out: dict[str, float] = {}
    for memory in modes:
        loss_sum = 0.0
        n = correct = 0
        for b in batches:
            b = b.to(device)
            loss, k, c = loss_and_counts(model, b, task, segment, memory)
            loss_sum += float(loss) * k
            n += k
            correct += c
        loss = loss_sum / max(n, 1)
        tag = "" if memory else "_no_memory"
        out[f"eval_loss{tag}"] = loss
        out[f"eval_accuracy{tag}"] = correct / max(n, 1)
        if task.metric == "perplexity":
            out[f"perplexity{tag}"] = math.exp(min(loss, 50.0))
    discard_aux_losses(model)       # what evaluation recorded never enters a training step
    model.train(was)
    return out


def data_parallel() -> tuple[int, int]:
    """``(world size, rank)`` of an initialised process group (``attnkit train --nproc N``), else ``(1, 0)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


def shard(batch: Batch, rank: int, world: int) -> Batch:
    """Rank ``rank``'s contiguous slice of a batch drawn for all ``world`` ranks."""
    if world == 1:
        return batch
    n = batch.inputs.shape[0] // world
    part = slice(rank * n, (rank + 1) * n)
    kpm = batch.key_padding_mask
    return Batch(batch.inputs[part], batch.targets[part], None if kpm is None else kpm[part])


def average_gradients(model: torch.nn.Module, loss: torch.Tensor, world: int) -> torch.Tensor:
    """All-reduce (mean) every gradient and the loss over the ranks: the step of one process on the global batch.

    The ranks' batches have equal sizes and scored-token counts (the tasks' layouts are fixed), so the mean of
    the ranks' mean losses is the global mean loss.
    """
    dist = torch.distributed
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    loss = loss.clone()
    dist.all_reduce(loss)
    return loss / world


def _record(holder: list[Any], fn: Any, *args: Any) -> None:
    holder.append(fn(*args))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _aux_collector() -> Any:
    """``attnkit.aux_losses`` when the installed core has it, else None (the lab runs on older cores)."""
    return getattr(attnkit, "aux_losses", None)


def discard_aux_losses(model: torch.nn.Module) -> None:
    """Forget auxiliary losses recorded outside a training step (e.g. by an evaluation pass)."""
    clear = getattr(attnkit, "clear_aux_losses", None)
    if clear is not None:
        clear(model)
        return
    collect = _aux_collector()
    if collect is not None:
        collect(model)


def train_one(task: Task, choice: names_mod.AttentionChoice, settings: TrainSettings, eval_set: list[Batch],
              *, out_dir: Path | None = None, show_progress: bool = True,
              checkpointing: Checkpointing | None = None) -> RunResult:
    """Train one attention on ``task``; failures are recorded in the result, never raised.

    The loss is the task loss plus every auxiliary loss the attention modules
    record (``sum(attnkit.aux_losses(model).values())``, weighted by their
    specs' default weights) when the installed attnkit has ``aux_losses``;
    each named auxiliary loss is logged (a moving average, like the training
    loss) in the curve points, the result and the progress line.

    ``checkpointing`` (:mod:`attnkit_lab.checkpoint`): save the training state
    every N steps (atomically) and, when resuming, continue from it.

    Raises:
        Interrupted: Ctrl-C (or numba's SystemError from it); its ``result``
            attribute holds this run so far, with status ``"interrupted"``.
        UsageError: resuming from a checkpoint of another task, attention or settings.
    """
    res = RunResult(choice.label, choice.name, dict(choice.options))
    where = {"step": None}
    t_start = time.perf_counter()
    try:
        _train_into(res, where, task, choice, settings, eval_set, out_dir=out_dir, show_progress=show_progress,
                    t_start=t_start, checkpointing=checkpointing)
    except BaseException as e:
        if not is_interrupt(e):
            raise
        res.status = "interrupted"
        step = where["step"]
        res.note = "interrupted" + (f" at step {step}" if step is not None else " before the first step")
        res.wall_s = time.perf_counter() - t_start
        _summarise(res, where)
        err = Interrupted(f"train {task.name} {choice.label}" + (f", step {step}" if step is not None else ""))
        err.result = res  # type: ignore[attr-defined]
        raise err from e
    return res


def _summarise(res: RunResult, where: dict[str, Any]) -> None:
    step_times, tokens = where.get("step_times") or [], where.get("tokens", 0)
    if step_times:
        total = sum(step_times)
        res.tokens_per_s = tokens / total if total > 0 else None
        res.step_time_s = statistics.median(step_times)
    last_eval = where.get("last_eval") or {}
    if last_eval:
        res.eval_loss = last_eval["eval_loss"]
        res.eval_accuracy = last_eval["eval_accuracy"]
        res.perplexity = last_eval.get("perplexity")
        res.perplexity_no_memory = last_eval.get("perplexity_no_memory")
        res.eval_loss_no_memory = last_eval.get("eval_loss_no_memory")
        res.eval_accuracy_no_memory = last_eval.get("eval_accuracy_no_memory")
        res.best_accuracy = max(p["eval_accuracy"] for p in res.curve)
    if where.get("aux"):
        res.aux_losses = dict(where["aux"])


def _train_into(res: RunResult, where: dict[str, Any], task: Task, choice: names_mod.AttentionChoice,
                settings: TrainSettings, eval_set: list[Batch], *, out_dir: Path | None, show_progress: bool,
                t_start: float, checkpointing: Checkpointing | None = None) -> None:
    device = torch.device(settings.device)
    block_choice = names_mod.parse_choice(settings.block, option="--block")
    cfg = ModelConfig(
        vocab_size=task.vocab_size, num_outputs=task.num_outputs, max_len=task.seq_len,
        dim=settings.dim, depth=settings.depth, heads=settings.heads, kind=task.kind, causal=task.causal,
        attention=choice.name, attention_options=dict(choice.options),
        mlp_ratio=settings.mlp_ratio, dropout=settings.dropout, token_shift=settings.token_shift,
        block=block_choice.name, block_options=dict(block_choice.options),
    )
    try:
        torch.manual_seed(settings.seed)
        model = LabModel(cfg).to(device)
    except Exception as e:  # noqa: BLE001 - recorded per attention
        raise_if_interrupt(e)
        res.status = "skipped" if names_mod.is_refusal(e) else "error"
        res.note = f"cannot build: {names_mod.describe_error(e)}"
        return
    res.params = model.num_parameters()
    world, rank = data_parallel()
    opt = torch.optim.AdamW(_param_groups(model, settings.weight_decay), lr=settings.lr, betas=(0.9, 0.98))
    # data parallel (attnkit train --nproc N): one stream of N x batch_size, each rank takes its slice
    stream = task.batches(settings.batch_size * world, settings.seed)
    step_times: list[float] = []
    aux_ema: dict[str, float] = {}
    where.update(step_times=step_times, tokens=0, last_eval={}, aux=aux_ema)
    ema = None
    memory_step = 1 if settings.steps > 1 else 0
    collect_aux = _aux_collector()
    start, every, ckpt_path = 0, 0, None
    identity = {"label": choice.label, "task": {"name": task.name, "options": task.options()},
                "settings": asdict(settings)}
    if checkpointing is not None:
        ckpt_path, every = checkpointing.path(safe_label(choice.label)), checkpointing.every
        state = load_state(ckpt_path, expect=identity) if checkpointing.resume else None
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start, ema, every = state["step"], state["ema"], every or state["every"]
            aux_ema.update(state["aux_ema"])
            res.curve = list(state["curve"])
            step_times.extend(state["step_times"])
            where.update(tokens=state["tokens"], last_eval=dict(state["last_eval"]))
            for _ in range(state["batches_drawn"]):  # the data position: the stream is reproducible
                next(stream)
            set_rng_state(state["rng"], device)
            status(f"{task.name} {choice.label}: resumed from {ckpt_path} at step {start}", enabled=show_progress)

    def save_state(done: int) -> None:
        atomic_save({"format": STATE_FORMAT, **identity, "step": done, "batches_drawn": done, "every": every,
                     "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state(device),
                     "ema": ema, "aux_ema": dict(aux_ema), "curve": list(res.curve),
                     "step_times": list(step_times), "tokens": where["tokens"],
                     "last_eval": dict(where["last_eval"])}, ckpt_path)

    def one_step(batch: Batch) -> tuple[float, dict[str, float]]:
        loss, _, _ = loss_and_counts(model, batch, task, settings.segment)
        aux = collect_aux(model) if collect_aux is not None else {}
        total = loss + sum(aux.values()) if aux else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        if world > 1:
            loss = average_gradients(model, loss.detach(), world)
        if settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        return float(loss.detach()), {k: float(v.detach()) for k, v in aux.items()}

    model.train()
    desc = f"{task.name} {choice.label}"
    with Progress(settings.steps, desc, enabled=show_progress) as bar:
        if start:
            bar.update(start)
        for step in range(start, settings.steps):
            where["step"] = step
            for g in opt.param_groups:
                g["lr"] = lr_at(step, settings)
            batch = shard(next(stream), rank, world).to(device)
            try:
                if step == memory_step:
                    holder: list[tuple[float, dict[str, float]]] = []
                    res.peak_bytes = peak_memory(partial(_record, holder, one_step, batch), device)
                    loss_val, aux_vals = holder[0]
                else:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    loss_val, aux_vals = one_step(batch)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    step_times.append(time.perf_counter() - t0)
                    where["tokens"] += batch.num_tokens
                if math.isfinite(loss_val) and all(math.isfinite(v) for v in aux_vals.values()):
                    ema = loss_val if ema is None else 0.9 * ema + 0.1 * loss_val
                    for name, v in aux_vals.items():
                        aux_ema[name] = v if name not in aux_ema else 0.9 * aux_ema[name] + 0.1 * v
                    if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
                        where["last_eval"] = evaluate(model, eval_set, task, device, settings.segment)
                        point = {"step": step + 1, "train_loss": ema, **where["last_eval"],
                                 "tokens": where["tokens"], "elapsed_s": time.perf_counter() - t_start}
                        if aux_ema:
                            point["aux_losses"] = dict(aux_ema)
                        stats = lab_stats(model)
                        if stats:
                            point["stats"] = stats
                            res.stats = stats
                        res.curve.append(point)
            except Exception as e:  # noqa: BLE001 - recorded per attention
                raise_if_interrupt(e)
                res.status = "skipped" if (step == 0 and names_mod.is_refusal(e)) else "error"
                if names_mod.is_oom(e):
                    res.status = "oom"
                res.note = f"step {step}: {names_mod.describe_error(e)}"
                break
            if not math.isfinite(loss_val):
                res.status, res.note = "diverged", f"non-finite loss at step {step}"
                break
            bad_aux = [n for n, v in aux_vals.items() if not math.isfinite(v)]
            if bad_aux:
                res.status, res.note = "diverged", f"non-finite auxiliary loss {bad_aux[0]!r} at step {step}"
                break
            post: dict[str, Any] = {"loss": ema}
            post.update(aux_ema)
            if where["last_eval"]:
                post["eval"] = where["last_eval"]["perplexity" if task.metric == "perplexity" else "eval_accuracy"]
            bar.update(1, **post)
            if ckpt_path is not None and every and rank == 0 and ((step + 1) % every == 0
                                                                  or step + 1 == settings.steps):
                save_state(step + 1)
    res.wall_s = time.perf_counter() - t_start
    _summarise(res, where)
    if out_dir is not None and res.status == "ok" and rank == 0:
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


# ---------------------------------------------------------------- reporting
def result_rows(task: Task, results: list[RunResult]) -> tuple[list[str], list[list[Any]]]:
    with_mem = any(r.eval_loss_no_memory is not None for r in results)
    if task.metric == "perplexity":
        headers = ["attention", "status", "val loss", "val ppl", "tokens/s", "peak step mem", "params", "time"]
        if with_mem:
            headers[4:4] = ["val ppl no memory"]
    else:
        headers = ["attention", "status", "accuracy", "best acc", "eval loss", "tokens/s", "peak step mem",
                   "params", "time"]
        if with_mem:
            headers[3:3] = ["accuracy no memory"]
    with_aux = any(r.aux_losses for r in results)
    with_stats = any(r.stats for r in results)
    rows = []
    for r in results:
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else None
        wall = f"{r.wall_s:.0f} s" if r.wall_s is not None else None
        status_cell = r.status if r.status == "ok" else f"{r.status}: {r.note}"[:70]
        mem = fmt_bytes(r.peak_bytes) if r.peak_bytes is not None else None
        if task.metric == "perplexity":
            row = [r.label, status_cell, r.eval_loss, r.perplexity, tps, mem, r.params, wall]
            if with_mem:
                row[4:4] = [r.perplexity_no_memory]
        else:
            row = [r.label, status_cell, r.eval_accuracy, r.best_accuracy, r.eval_loss, tps, mem, r.params, wall]
            if with_mem:
                row[3:3] = [r.eval_accuracy_no_memory]
        if with_aux:
            row.append(", ".join(f"{n} {_cell_number(v)}" for n, v in r.aux_losses.items()) or None)
        if with_stats:
            row.append("; ".join(f"{n} {_cell_stat(v)}" for n, v in r.stats.items()) or None)
        rows.append(row)
    if with_aux:
        headers.append("aux losses")
    if with_stats:
        headers.append("module stats (last evaluation)")
    return headers, rows


def _cell_number(v: float) -> str:
    return f"{v:.3g}"


def _cell_stat(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(_cell_stat(x) for x in v) + "]"
    return _cell_number(v) if isinstance(v, float) else str(v)


def plot_curves(path: Path, task: Task, results: list[RunResult], title: str) -> None:
    from .plotting import learning_curves

    learning_curves(path, task, results, title)


def run_train(task: Task, choices: list[names_mod.AttentionChoice], settings: TrainSettings, out: RunDir, *,
              show_progress: bool = True, preset: str | None = None, extra_config: dict[str, Any] | None = None,
              checkpointing: Checkpointing | None = None) -> dict[str, Any]:
    """Train every choice on ``task`` and write the results into ``out`` (an opened RunDir).

    Raises:
        Interrupted: on Ctrl-C, after the results so far (finished runs, and
            the interrupted one with status ``"interrupted"``) are written,
            without the plot.
    """
    settings.validate()
    if settings.segment and task.kind != "tokens":
        raise UsageError(f"--segment applies to tokens tasks (lm, copy, mqar), not to {task.name}")
    device = torch.device(settings.device)
    results: list[RunResult] = []
    info: dict[str, Any] = {}
    interrupted: BaseException | None = None
    assert out.tmp is not None
    try:
        # the global batch size: --nproc N --batch-size B evaluates like one process with N x B
        eval_set = task.eval_batches(settings.batch_size * data_parallel()[0], settings.eval_batches,
                                     settings.seed + 1_000_003)
        info.update(task.extra_info())
        if isinstance(task, ListOpsTask):
            label, frac = ListOpsTask.majority_floor(eval_set)
            info["majority_class"] = label
            info["majority_floor"] = frac
            print(f"listops: majority-class floor on the evaluation set: {frac:.3f} (always answering {label})")
        for choice in choices:
            r = train_one(task, choice, settings, eval_set, out_dir=out.tmp, show_progress=show_progress,
                          checkpointing=checkpointing)
            if r.status != "ok":
                status(f"{task.name} {choice.label}: {r.status}: {r.note}", enabled=True)
            results.append(r)
    except BaseException as e:
        if not is_interrupt(e):
            raise
        interrupted = e
        partial_result = getattr(e, "result", None)
        if partial_result is not None:
            results.append(partial_result)
    env = environment(str(device))
    headers, rows = result_rows(task, results)
    table = format_table(rows, headers, align="ll" + "r" * (len(headers) - 2))
    floor = ""
    if "majority_floor" in info:
        floor = f"\nMajority-class floor: {info['majority_floor']:.3f}\n"
    steps_line = (f"{task.name}: {settings.steps} steps × batch {settings.batch_size} × length {task.seq_len}, "
                  f"dim {settings.dim}, depth {settings.depth}, heads {settings.heads}, seed {settings.seed}"
                  + (f", block {settings.block}" if settings.block != "pre-norm" else ""))
    world = data_parallel()[0]
    if world > 1:
        steps_line += f" (per process: {world} processes, global batch {world * settings.batch_size})"
    if settings.segment:
        steps_line += (f", segments of {settings.segment} (state carried across segments by attentions with "
                       "'segment' streaming; 'no memory' resets it every segment)")
    stopped = ""
    if interrupted is not None:
        finished = sum(r.status != "interrupted" for r in results)
        stopped = (f"\n**Interrupted** (Ctrl-C) during {_where(interrupted)}: results so far "
                   f"({finished} of {len(choices)} attentions finished).\n")
    aux_line = ""
    if any(r.aux_losses for r in results):
        aux_line = ("\nAuxiliary losses (weighted, moving average at the last step) were added to the training "
                    "loss; the train loss and the curves are the task loss alone.\n")
    md = (f"# attnkit train {task.name}\n\n{steps_line}\n\nMachine: {machine_line(env)}\n\n"
          f"Command: `{env['command']}`\n{stopped}{floor}{aux_line}\n{table}\n")
    payload = {
        "command": "train",
        "task": {"name": task.name, "summary": task.summary, "options": task.options(), "info": info},
        "preset": preset,
        "settings": asdict(settings),
        "memory_method": MEMORY_METHOD.get(device.type, ""),
        "environment": env,
        "config": extra_config or {},
        "interrupted": interrupted is not None,
        "processes": world,
        "runs": [asdict(r) for r in results],
    }
    out.write_json("results.json", payload)
    flat = [{k: v for k, v in asdict(r).items() if k not in ("curve", "aux_losses", "stats")}
            | {f"aux:{n}": v for n, v in r.aux_losses.items()} for r in results]
    out.write_csv("results.csv", flat)
    curve_rows = [{"attention": r.label, **{k: v for k, v in p.items() if k not in ("aux_losses", "stats")},
                   **{f"aux:{n}": v for n, v in p.get("aux_losses", {}).items()}}
                  for r in results for p in r.curve]
    out.write_csv("curves.csv", curve_rows)
    out.write_text("table.md", md)
    print(f"\n{steps_line}\n{stopped}{floor}{table}")
    if interrupted is not None:
        raise Interrupted(_where(interrupted)) from interrupted
    title = f"{task.name}: {steps_line.split(': ', 1)[1]}"
    if any(r.curve for r in results):
        plot_curves(out.file("learning_curves.png"), task, results, title)
    return payload


def _where(exc: BaseException) -> str:
    where = getattr(exc, "where", "")
    return where or "the run"
