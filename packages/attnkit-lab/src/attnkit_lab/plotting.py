"""Figures (PNG) for bench, error and train. matplotlib is imported lazily,
with the non-interactive Agg backend, only when a figure is written."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .results import atomic_write_bytes

MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, dpi: int = 90) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())
    _plt().close(fig)


def _style(i: int) -> dict[str, Any]:
    markers = "osD^v<>ph*"
    return {"marker": markers[i % len(markers)], "markersize": 4, "linewidth": 1.5}


def bench_figure(path: Path, records: Sequence[dict[str, Any]], labels: Sequence[str], title: str,
                 modes: Sequence[str] = ("fwd", "fwdbwd"), memory: bool = True) -> None:
    """Time (and memory) vs length, log-log; one panel per mode and quantity."""
    plt = _plt()
    rows = 2 if memory else 1
    fig, axes = plt.subplots(rows, len(modes), figsize=(5.2 * len(modes), 3.6 * rows), squeeze=False)
    series = ["sdpa"] + [lb for lb in labels if lb != "sdpa"]
    for j, mode in enumerate(modes):
        for i, qty in enumerate(["median_s", "peak_bytes"][:rows]):
            ax = axes[i][j]
            for k, label in enumerate(series):
                pts = sorted(
                    (r["length"], r[qty]) for r in records
                    if r["label"] == label and r["mode"] == mode and r["status"] == "ok" and r.get(qty)
                )
                if not pts:
                    continue
                xs, ys = zip(*pts)
                if qty == "peak_bytes":
                    ys = tuple(y / 2**20 for y in ys)
                kw = _style(k)
                if label == "sdpa":
                    kw.update(color="black", linestyle="--")
                ax.plot(xs, ys, label="SDPA (exact)" if label == "sdpa" else label, **kw)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L")
            ax.set_ylabel("median time (s)" if qty == "median_s" else "peak memory (MiB)")
            ax.set_title(f"{MODE_TITLES.get(mode, mode)}: {'time' if qty == 'median_s' else 'memory'}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
    handles, lbls = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, lbls, loc="lower center", ncol=min(4, len(lbls)), fontsize=8,
                   bbox_to_anchor=(0.5, -0.02 - 0.03 * math.ceil(len(lbls) / 4)))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def error_figure(path: Path, budget_rows: Sequence[dict[str, Any]], length_rows: Sequence[dict[str, Any]],
                 title: str, metric: str = "out_rel_err") -> None:
    """Left: error vs budget at a fixed length. Right: error vs length at the default budget.

    Colour = mechanism, line style = input distribution.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = ["-", "--", ":", "-."]
    names = sorted({r["label"] for r in list(budget_rows) + list(length_rows)})
    dists = []
    for r in list(budget_rows) + list(length_rows):
        if r["dist"] not in dists:
            dists.append(r["dist"])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, rows, xkey, xlabel in ((axes[0], budget_rows, "budget", "budget"),
                                   (axes[1], length_rows, "length", "sequence length L")):
        for i, name in enumerate(names):
            for j, dist in enumerate(dists):
                pts = sorted((r[xkey], r[metric]) for r in rows
                             if r["label"] == name and r["dist"] == dist and r.get(metric) is not None
                             and r.get(xkey) is not None)
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=colors[i % len(colors)], linestyle=styles[j % len(styles)],
                        marker="o", markersize=3, label=f"{name} · {dist}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("relative error of the output" if metric == "out_rel_err" else "relative error of the weights")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title("error vs budget", fontsize=10)
    axes[1].set_title("error vs length (default budget)", fontsize=10)
    handles, lbls = [], []
    for ax in axes:
        h, lb = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lb):
            if ll not in lbls:
                handles.append(hh)
                lbls.append(ll)
    if handles:
        fig.legend(handles, lbls, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def learning_curves(path: Path, task: Any, results: Sequence[Any], title: str) -> None:
    """Evaluation metric and loss vs training step, one line per attention."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ppl = task.metric == "perplexity"
    for i, r in enumerate(results):
        if not r.curve:
            continue
        steps = [p["step"] for p in r.curve]
        kw = _style(i)
        axes[0].plot(steps, [p["perplexity" if ppl else "eval_accuracy"] for p in r.curve], label=r.label, **kw)
        axes[1].plot(steps, [p["eval_loss"] for p in r.curve], label=r.label, **kw)
    axes[0].set_ylabel("validation perplexity" if ppl else "evaluation accuracy")
    if ppl:
        axes[0].set_yscale("log")
    else:
        axes[0].set_ylim(-0.02, 1.02)
    axes[1].set_ylabel("evaluation loss")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)
