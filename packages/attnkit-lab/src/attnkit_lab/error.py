"""``attnkit error``: approximation error against exact softmax attention.

Metrics, per (mechanism, budget, length, input distribution), averaged over
``trials`` (each trial draws new inputs and rebuilds the mechanism with a new
seed, so random features are redrawn):

- ``out_rel_err``: ``‖A(q,k,v) − softmax(qkᵀ·s)v‖_F / ‖softmax(qkᵀ·s)v‖_F``
  with ``v ~ N(0, 1)``; the exact reference is SDPA in float64.
- ``weights_rel_err``: the same for the attention-weighted sums of one-hot
  values: with ``v = I`` (``S`` one-hot value vectors) the output *is* the
  matrix of attention weights the mechanism implies, compared with the exact
  softmax weights. Computed while ``L ≤ weights_max_length`` (it costs
  ``O(L·S)`` memory).

Input distributions:

- ``gauss-tT``: ``q, k ~ N(0, 1/T)`` per coordinate, so the logits
  ``q·k/√D`` have standard deviation ``1/T``: a lower temperature ``T``
  means sharper attention, which is harder to approximate;
- ``trained``: ``q, k, v`` captured at every layer of a model trained by
  ``attnkit train`` (``--from-run DIR``) on its own task's evaluation data;
  lengths are prefixes of the trained length.

The budget is the option that sets a mechanism's cost (``num_features``,
``num_landmarks``, ``rank``, ``window``, ...), found from the spec's options
(:func:`attnkit_lab.names.budget_option`) or given with ``--budget-option``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from attnkit.errors import UsageError

from . import names as names_mod
from .bench import DTYPES
from .interrupts import Interrupted, is_interrupt, raise_if_interrupt
from .progress import Progress, status
from .results import RunDir, environment, format_table, machine_line


@dataclass
class ErrorSettings:
    """What to measure."""

    lengths: list[int] = field(default_factory=lambda: [256, 1024, 4096])
    budgets: list[int] = field(default_factory=lambda: [16, 64, 256])
    budget_length: int = 1024
    temperatures: list[float] = field(default_factory=lambda: [8.0, 2.0, 0.5])
    trials: int = 3
    batch: int = 1
    heads: int = 2
    head_dim: int = 64
    causal: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    weights_max_length: int = 1024
    budget_option: str | None = None
    seed: int = 0


@dataclass
class Inputs:
    """A distribution's q/k/v at its longest length; ``take(L)`` gives prefixes."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    description: str = ""

    @property
    def max_length(self) -> int:
        return self.q.shape[-2]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]


# ------------------------------------------------------------------ references
def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Exact softmax attention in float64 (SDPA), shapes as SDPA."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)


def rel_err(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``‖approx − ref‖ / ‖ref‖`` (over the whole tensor)."""
    diff = (approx.double() - ref).norm()
    den = ref.norm()
    return float(diff / den) if den > 0 else float(diff)


def gaussian_inputs(settings: ErrorSettings, temperature: float, length: int, trial: int) -> Inputs:
    g = torch.Generator().manual_seed(settings.seed * 7919 + trial * 104729 + int(round(1000 * temperature)))
    shape = (settings.batch, settings.heads, length, settings.head_dim)
    std = temperature ** -0.5
    q = torch.randn(shape, generator=g) * std
    k = torch.randn(shape, generator=g) * std
    v = torch.randn(shape, generator=g)
    return Inputs(f"gauss-t{temperature:g}", q, k, v, settings.causal,
                  f"q, k ~ N(0, 1/{temperature:g}): logit std {1 / temperature:g}")


# ------------------------------------------------------------ trained inputs
def _find_checkpoint(path: Path) -> Path:
    if path.is_file():
        return path
    if (path / "checkpoint.pt").is_file():
        return path / "checkpoint.pt"
    found = sorted(path.glob("*/checkpoint.pt"))
    if not found:
        raise UsageError(f"--from-run {str(path)!r}: no checkpoint.pt found; expected a directory written by "
                         "`attnkit train` (or one of its per-attention sub-directories)")
    # prefer a model trained with exact attention: its q/k are what approximations must match
    import attnkit

    for ckpt in found:
        try:
            name = torch.load(ckpt, map_location="cpu", weights_only=False)["model"]["attention"]
            if attnkit.get_spec(name).exact:
                return ckpt
        except Exception:  # noqa: BLE001 - fall back to the first checkpoint
            continue
    return found[0]


def trained_inputs(path: str | Path, *, batch: int, seed: int, label: str | None = None) -> Inputs:
    """Capture q/k/v at every attention layer of a trained model on its task's data.

    Returns inputs of shape (batch·depth, H, L, D): the layers are stacked
    along the batch dimension.
    """
    from .models import LabModel, ModelConfig
    from .tasks import task_class

    ckpt_path = _find_checkpoint(Path(path))
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        cfg = ModelConfig(**ckpt["model"])
        task = task_class(ckpt["task"]["name"])(**ckpt["task"]["options"])
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"--from-run {str(ckpt_path)!r} is not a readable attnkit-lab checkpoint: {e}") from None
    model = LabModel(cfg)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        q, k, v = (list(args) + [kwargs.get(n) for n in ("q", "k", "v")[len(args):]])[:3]
        captured.append((q.detach(), k.detach(), v.detach()))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.attention_modules()]
    try:
        data = task.eval_batches(batch, 1, seed + 2_000_003)[0]
        with torch.no_grad():
            model(data.inputs, data.key_padding_mask)
    finally:
        for h in handles:
            h.remove()
    q = torch.cat([c[0] for c in captured])
    k = torch.cat([c[1] for c in captured])
    v = torch.cat([c[2] for c in captured])
    try:
        where = ckpt_path.relative_to(Path(path)).as_posix()
    except ValueError:
        where = ckpt_path.name
    where = f"{label or path}/{where}" if where != "." else str(label or path)
    desc = (f"q/k/v of all {len(captured)} layers of {ckpt.get('label', cfg.attention)!r} trained on "
            f"{task.name} (L={q.shape[-2]}, H={q.shape[1]}, D={q.shape[-1]}; {where})")
    return Inputs("trained", q, k, v, cfg.causal, desc)


# ---------------------------------------------------------------- measuring
def measure(choice: names_mod.AttentionChoice, inputs: Inputs, length: int, settings: ErrorSettings,
            trial_inputs: list[Inputs] | None = None) -> dict[str, Any]:
    """Errors of one configuration, averaged over trials."""
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    outs, weights = [], []
    for t in range(settings.trials):
        src = trial_inputs[t] if trial_inputs else inputs
        q, k, v = (x[..., :length, :] for x in (src.q, src.k, src.v))
        mod = names_mod.build(choice, num_heads=src.heads, head_dim=src.head_dim, seed=settings.seed + 1009 * t)
        mod = mod.to(device=device, dtype=dtype).eval()
        with torch.no_grad():
            approx = mod(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), causal=src.causal)
            outs.append(rel_err(approx.cpu(), exact(q, k, v, src.causal)))
            if length <= settings.weights_max_length:
                eye = torch.eye(length, dtype=torch.float64).expand(q.shape[0], q.shape[1], length, length)
                a = mod(q.to(device, dtype), k.to(device, dtype), eye.to(device, dtype), causal=src.causal)
                weights.append(rel_err(a.cpu(), exact(q, k, eye, src.causal)))
    rec: dict[str, Any] = {"status": "ok", "out_rel_err": statistics.fmean(outs),
                           "out_rel_err_std": statistics.pstdev(outs) if len(outs) > 1 else 0.0}
    if weights:
        rec["weights_rel_err"] = statistics.fmean(weights)
        rec["weights_rel_err_std"] = statistics.pstdev(weights) if len(weights) > 1 else 0.0
    if not all(math.isfinite(x) for x in outs):
        rec["status"], rec["note"] = "error", "non-finite output"
    return rec


def run_error(choices: list[names_mod.AttentionChoice], settings: ErrorSettings, out: RunDir, *,
              from_run: str | None = None, show_progress: bool = True, preset: str | None = None,
              from_run_label: str | None = None, budget_hint: bool = True) -> dict[str, Any]:
    """Measure every choice over budgets and lengths; write results into ``out``.

    ``from_run_label``: how to name ``from_run`` in the results (default: the path).
    ``budget_hint``: print a hint (use ``--budget-option``) for a mechanism
    without a budget option; the table states it either way. The demo, which
    has no such option, turns it off.

    Raises:
        Interrupted: on Ctrl-C, after the configurations measured so far are
            written (``"interrupted": true``; no plot).
    """
    specs = {c.label: names_mod.resolve_spec(c.name) for c in choices}
    # (the choice as given, the configuration run, budget option, budget, sweep)
    plan: list[tuple[names_mod.AttentionChoice, names_mod.AttentionChoice, str | None, int | None, str]] = []
    budget_opts: dict[str, str | None] = {}
    for c in choices:
        opt = settings.budget_option or names_mod.budget_option(specs[c.label])
        if settings.budget_option and settings.budget_option not in names_mod.spec_options(specs[c.label]):
            opt = None
        budget_opts[c.label] = opt
        if opt is not None and opt not in c.options:
            for b in settings.budgets:
                plan.append((c, c.with_options(**{opt: b}), opt, b, "budget"))
        default = None
        if opt:
            o = names_mod.spec_options(specs[c.label]).get(opt)
            default = c.options.get(opt, o.default if o is not None else None)
        plan.append((c, c, opt, default, "length"))
    if settings.budget_option and not any(budget_opts.values()):
        raise UsageError(f"--budget-option {settings.budget_option!r} is not an option of any of "
                         f"{', '.join(c.label for c in choices)}")

    dists: list[tuple[str, Any]] = [(f"gauss-t{t:g}", t) for t in settings.temperatures]
    trained: Inputs | None = None
    if from_run is not None:
        trained = trained_inputs(from_run, batch=max(1, settings.batch), seed=settings.seed, label=from_run_label)
        dists.append(("trained", None))

    def inputs_for(dist: Any, length: int) -> tuple[Inputs, list[Inputs] | None]:
        name, temp = dist
        if name == "trained":
            assert trained is not None
            return trained, None
        trials = [gaussian_inputs(settings, temp, length, t) for t in range(settings.trials)]
        return trials[0], trials

    jobs = []
    for base, ch, opt, budget, sweep in plan:
        for dist in dists:
            if sweep == "budget":
                lengths = [settings.budget_length]
            elif dist[0] == "trained":
                assert trained is not None
                Lt = trained.max_length  # prefixes up to the trained length, and the trained length itself
                lengths = sorted({L for L in settings.lengths if L < Lt} | {Lt})
            else:
                lengths = settings.lengths
            for L in lengths:
                jobs.append((base, ch, opt, budget, sweep, L, dist))
    records: list[dict[str, Any]] = []
    interrupted: BaseException | None = None
    where = "the start"
    try:
        _run_jobs(jobs, settings, trained, inputs_for, records, show_progress)
    except BaseException as e:
        if not is_interrupt(e):
            raise
        interrupted = e
        where = f"job {len(records) + 1} of {len(jobs)}"
        if len(records) < len(jobs):
            _, ch, _, _, sweep, L, dist = jobs[len(records)]
            where += f" ({ch.label}, {sweep} sweep, L={L}, {dist[0]})"

    env = environment(settings.device)
    dist_desc = {f"gauss-t{t:g}": f"q, k ~ N(0, 1/{t:g}) per coordinate (logit std {1 / t:g}), v ~ N(0, 1)"
                 for t in settings.temperatures}
    if trained is not None:
        dist_desc["trained"] = trained.description
    text = render(records, choices, specs, budget_opts, settings, dist_desc, env)
    payload = {
        "command": "error",
        "preset": preset,
        "settings": asdict(settings),
        "from_run": (from_run_label or str(from_run)) if from_run else None,
        "distributions": dist_desc,
        "budget_options": budget_opts,
        "reference": "torch.nn.functional.scaled_dot_product_attention in float64",
        "environment": env,
        "records": records,
    }
    if interrupted is not None:
        payload["interrupted"] = True
        text += (f"\n**Interrupted** (Ctrl-C) at {where}: the tables hold the {len(records)} of {len(jobs)} "
                 "configurations measured before it.\n")
    out.write_json("results.json", payload)
    out.write_csv("results.csv", records, ["label", "config", "name", "sweep", "budget_option", "budget", "length",
                                           "dist", "status", "out_rel_err", "out_rel_err_std", "weights_rel_err",
                                           "weights_rel_err_std", "note"])
    out.write_text("table.md", text)
    if interrupted is not None:
        print(text)
        raise Interrupted(f"error {where}") from interrupted
    ok = [r for r in records if r.get("status") == "ok"]
    if ok:
        from .plotting import error_figure

        budget_rows = [r for r in ok if r["sweep"] == "budget"]
        length_rows = [r for r in ok if r["sweep"] == "length"]
        error_figure(out.file("error.png"), budget_rows, length_rows,
                     f"relative error vs exact softmax; budget sweep at L={settings.budget_length}, "
                     f"{'causal' if settings.causal else 'non-causal'}, mean of {settings.trials} trials")
    print(text)
    if budget_hint:
        for c in choices:
            if budget_opts[c.label] is None:
                status(f"error: {c.label}: no budget option found; only its default configuration was measured "
                       "(use --budget-option NAME)")
    return payload


def _run_jobs(jobs: list[tuple[Any, ...]], settings: ErrorSettings, trained: Inputs | None, inputs_for: Any,
              records: list[dict[str, Any]], show_progress: bool) -> None:
    """Measure every job, appending one record per job to ``records`` (interrupts propagate)."""
    with Progress(len(jobs), "error", enabled=show_progress) as bar:
        for base, ch, opt, budget, sweep, L, dist in jobs:
            rec: dict[str, Any] = {"label": base.label, "config": ch.label, "name": ch.name, "sweep": sweep,
                                   "budget_option": opt, "budget": budget, "length": L, "dist": dist[0]}
            bar.set_postfix(attn=ch.label, L=L, dist=dist[0])
            if dist[0] == "trained":
                assert trained is not None
                rec["length"] = min(L, trained.max_length)
            try:
                inputs, trial_inputs = inputs_for(dist, L)
                rec.update(measure(ch, inputs, rec["length"], settings, trial_inputs))
            except Exception as e:  # noqa: BLE001 - one configuration never stops the sweep
                raise_if_interrupt(e)
                rec.update(status="oom" if names_mod.is_oom(e) else "skipped" if names_mod.is_refusal(e) else "error",
                           note=names_mod.describe_error(e))
            records.append(rec)
            bar.update(1)


def _fmt_err(r: dict[str, Any] | None, key: str) -> str:
    if r is None:
        return "—"
    if r.get("status") != "ok":
        return r.get("status", "—")
    v = r.get(key)
    if v is None:
        return "—"
    s = r.get(key + "_std")
    return f"{v:.3g}" + (f" ± {s:.2g}" if s else "")


def render(records: list[dict[str, Any]], choices: list[names_mod.AttentionChoice], specs: dict[str, Any],
           budget_opts: dict[str, str | None], settings: ErrorSettings, dist_desc: dict[str, str],
           env: dict[str, Any]) -> str:
    dists = list(dist_desc)
    parts = [f"# attnkit error\n\nRelative error against exact softmax attention (float64 SDPA), "
             f"{'causal' if settings.causal else 'non-causal'}, B={settings.batch}, H={settings.heads}, "
             f"D={settings.head_dim}, {settings.dtype}, mean ± std over {settings.trials} trials.\n\n"
             f"Machine: {machine_line(env)}\n\nCommand: `{env['command']}`\n\nInputs:\n"
             + "\n".join(f"- `{k}`: {v}" for k, v in dist_desc.items())]
    mech = []
    for c in choices:
        s = specs[c.label]
        approx = "exact" if s.exact else (s.approximation or "approximate")
        opt = budget_opts[c.label]
        budget = f"budget option: `{opt}`" if opt else "no budget option: measured at its default configuration only"
        mech.append(f"- `{c.label}`: {approx}; {budget}")
    parts.append("Mechanisms:\n" + "\n".join(mech))
    for key, what in (("out_rel_err", "output"), ("weights_rel_err", "attention weights")):
        brows = [r for r in records if r["sweep"] == "budget"]
        if brows and (key == "out_rel_err" or any(r.get(key) is not None for r in brows)):
            idx = {(r["label"], r["budget"], r["dist"]): r for r in brows}
            keys = sorted({(r["label"], r["budget"]) for r in brows}, key=lambda x: (x[0], x[1]))
            rows = [[lb, b] + [_fmt_err(idx.get((lb, b, d)), key) for d in dists] for lb, b in keys]
            parts.append(f"## Relative error of the {what} vs budget (L={settings.budget_length}; "
                         f"`trained`: min(L, trained length))\n\n"
                         + format_table(rows, ["attention", "budget"] + dists, align="lr" + "r" * len(dists)))
        lrows = [r for r in records if r["sweep"] == "length"]
        if lrows and (key == "out_rel_err" or any(r.get(key) is not None for r in lrows)):
            idx = {(r["config"], r["length"], r["dist"]): r for r in lrows}
            keys = sorted({(r["config"], r["length"]) for r in lrows})
            rows = [[cfg, L] + [_fmt_err(idx.get((cfg, L, d)), key) for d in dists] for cfg, L in keys]
            parts.append(f"## Relative error of the {what} vs length (default budget)\n\n"
                         + format_table(rows, ["attention", "L"] + dists, align="lr" + "r" * len(dists)))
    if settings.weights_max_length < 1:
        parts.append("The attention-weights error was not computed (--weights-max-length 0).")
    elif any(r.get("length", 0) > settings.weights_max_length for r in records):
        parts.append(f"The attention-weights error is computed for L ≤ {settings.weights_max_length} "
                     "(--weights-max-length); `—` above that.")
    if "trained" in dist_desc:
        parts.append("`trained` inputs exist only up to the trained model's length: the length sweep uses "
                     "prefixes up to it, the budget sweep min(budget length, trained length).")
    notes = {(r["config"], r["status"], r.get("note", "")) for r in records if r.get("status") != "ok"}
    if notes:
        parts.append("## Not measured\n\n" + "\n".join(f"- {c}: {s}: {n}" for c, s, n in sorted(notes)))
    return "\n\n".join(parts) + "\n"
