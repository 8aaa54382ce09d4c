"""One figure of ``attnkit error`` budget sweeps: relative output error vs budget, one panel per mechanism.

Usage (each DIR an ``attnkit error --out DIR`` run)::

    python benchmarks/plot_error.py OUT.png DIR [DIR ...]
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, dirs = Path(argv[0]), [Path(d) for d in argv[1:]]
    series: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    option: dict[str, str] = {}
    for d in dirs:
        with open(d / "results.csv") as f:
            for row in csv.DictReader(f):
                if row["sweep"] != "budget" or row["status"] != "ok":
                    continue
                series[row["name"]][row["dist"]].append((float(row["budget"]), float(row["out_rel_err"])))
                option[row["name"]] = row["budget_option"]
    names = list(series)
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for dist, pts in sorted(series[name].items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=dist)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel(option[name])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("relative error vs softmax (L=1024)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
