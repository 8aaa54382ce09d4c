"""How far back a model trained with segment memory looks: validation perplexity against the memory used.

Loads the checkpoints written by ``attnkit train lm --segment N --out DIR``
(one per attention), rebuilds each model and evaluates the same validation
windows in segments of ``N`` with the memory of every ``transformer-xl`` /
``compressive`` module set to each of ``--mem-lens`` at evaluation time
(0 = no memory: every segment alone). A small-scale version of
Transformer-XL's relative effective context length: the longest attention
span that still lowers perplexity (here: the smallest span within
``--tolerance`` of the best perplexity). Needs attnkit-lab.

    python plugins/attnkit-memory/benchmarks/context_length.py RUN_DIR --mem-lens 0,8,16,32,48,64,96,112
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from attnkit_lab.models import LabModel, ModelConfig
from attnkit_lab.tasks.lm import LMTask
from attnkit_lab.train import evaluate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--mem-lens", default="0,8,16,32,48,64,96,112")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tolerance", type=float, default=0.01, help="relative perplexity tolerance of 'effective'")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    run = Path(args.run_dir)
    results = json.loads((run / "results.json").read_text())
    segment = results["settings"]["segment"]
    task = LMTask(**{k: (tuple(v) if k == "text" else v) for k, v in results["task"]["options"].items()})
    batches = task.eval_batches(args.batch_size, args.eval_batches, results["settings"]["seed"] + 1_000_003)
    rows = []
    for r in results["runs"]:
        if not r.get("checkpoint"):
            continue
        ck = torch.load(run / r["checkpoint"], weights_only=False)
        model = LabModel(ModelConfig(**ck["model"]))
        model.load_state_dict(ck["state_dict"])
        mods = [m for m in model.attention_modules() if hasattr(m, "mem_len")]
        trained = mods[0].mem_len if mods else 0
        curve = []
        for m in [int(s) for s in args.mem_lens.split(",")]:
            if not mods and m:
                continue
            for mod in mods:
                if m:
                    mod.mem_len = m
            ev = evaluate(model, batches, task, torch.device("cpu"), segment)
            ppl = ev["perplexity"] if m else ev.get("perplexity_no_memory", ev["perplexity"])
            span = segment + m
            if mods and m and hasattr(mods[0], "cmem_len"):
                span = segment + m + mods[0].cmem_len * mods[0].rate
            span = min(span, task.seq_len)     # nothing before the evaluation window exists
            curve.append({"mem_len": m, "positions_reachable": span, "perplexity": ppl})
            print(f"{r['label']}: eval mem_len {m:4d} (reaches {span:4d} positions back): ppl {ppl:.3f}", flush=True)
        best = min(c["perplexity"] for c in curve)
        eff = min(c["positions_reachable"] for c in curve if c["perplexity"] <= best * (1 + args.tolerance))
        rows.append({"label": r["label"], "curve": curve, "best_perplexity": best, "effective_context": eff,
                     "trained_mem_len": trained})
        print(f"{r['label']}: effective context {eff} positions (within {args.tolerance:.0%} of the best ppl "
              f"{best:.3f}; trained with mem_len {trained})")
    if args.out:
        Path(args.out).write_text(json.dumps({"run": str(run), "segment": segment, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
