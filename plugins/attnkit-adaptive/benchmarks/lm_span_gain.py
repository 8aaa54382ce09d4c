"""Wall-clock gain of learned spans: one LM training step at the learned spans vs at max_span, interleaved.

Builds the lab's LM model (dim 128, depth 2, 4 heads, L = 512, batch 8, as
``attnkit train lm --seq-len 512``) with ``adaptive-span@max_span=512``, sets
every head's span to the learned values read from a run's ``results.json``
(``--learned``) or to ``max_span``, and times a forward+backward step of each
alternately (the same moments of the shared machine), median of ``--repeats``.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-adaptive/benchmarks/lm_span_gain.py \
        --results plugins/attnkit-adaptive/benchmarks/results/train-lm-spans/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from attnkit_lab.models import LabModel, ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", required=True)
    p.add_argument("--label", default="adaptive-span@max_span=512,init_span=0")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    run = next(r for r in json.load(open(args.results))["runs"] if r["label"] == args.label)
    learned = {k: v for k, v in run["stats"].items() if k.endswith(".spans")}
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=1024, num_outputs=1024, max_len=512, dim=128, depth=2, heads=4,
                      attention="adaptive-span", attention_options={"max_span": 512})
    model = LabModel(cfg)
    mods = dict(model.named_modules())
    x = torch.randint(0, 1024, (8, 512))

    def set_spans(which: str) -> None:
        with torch.no_grad():
            for key, spans in learned.items():
                m = mods[key.rsplit(".", 1)[0]]
                val = torch.tensor(spans) / m.max_span if which == "learned" else torch.ones(len(spans))
                m.span_fraction.copy_(val)

    def step() -> float:
        t0 = time.perf_counter()
        model(x).float().logsumexp(-1).mean().backward()
        return time.perf_counter() - t0

    times = {"learned": [], "max": []}
    for which in ("learned", "max"):
        set_spans(which)
        step()  # warm-up
    for _ in range(args.repeats):
        for which in ("learned", "max"):
            set_spans(which)
            times[which].append(step())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"learned spans {learned}")
    print(f"train step (fwd+bwd, batch 8 x 512): learned spans {med['learned'] * 1e3:.0f} ms, max_span 512 "
          f"{med['max'] * 1e3:.0f} ms, gain {med['max'] / med['learned']:.2f}x")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
