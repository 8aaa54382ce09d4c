"""ACT ponder steps against problem depth: a Universal Transformer (``act`` block) on ListOps.

Why ListOps: its expressions nest operators to a depth that varies from one
example to the next and is known exactly, and evaluating a deeper expression
needs more sequential composition, which is what ACT is meant to spend extra
steps on (Dehghani et al. 2019 motivate ACT with exactly this).

The lab's ListOps generator (``attnkit_lab.tasks.listops``) and model
(``LabModel`` with ``block="act"``, depth 1: one shared block applied up to
``max_steps`` times) are trained with the task loss plus the ponder cost
(``attnkit.aux_losses``). Then fresh expressions are grouped by nesting depth
and, per depth, the mean ACT steps N per real position (and N + R), the accuracy
and the count are recorded.

    flock /tmp/attnkit-bench.lock python plugins/attnkit-adaptive/benchmarks/act_listops_depth.py
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit
from attnkit_lab.models import LabModel, ModelConfig
from attnkit_lab.tasks.listops import VOCAB, ListOpsTask, evaluate, tokens


def depth(tree) -> int:
    """Operator nesting depth: a value is 0, an operator over values 1, ..."""
    return 0 if isinstance(tree, int) else 1 + max(depth(a) for a in tree[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-depth", type=int, default=5)
    p.add_argument("--max-args", type=int, default=3)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=8, help="ACT max_steps")
    p.add_argument("--ponder-weight", type=float, default=0.01)
    p.add_argument("--halting-bias", type=float, default=None,
                   help="initial bias of the halting unit (the block's default 1.0: p = 0.73, one step at init)")
    p.add_argument("--eval-examples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    up0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    torch.manual_seed(args.seed)
    task = ListOpsTask(max_depth=args.max_depth, max_args=args.max_args, min_length=1, max_length=args.max_length)
    cfg = ModelConfig(vocab_size=task.vocab_size, num_outputs=10, max_len=task.seq_len, dim=64, depth=1, heads=4,
                      kind="classify", causal=False, attention="softmax", block="act",
                      block_options={"max_steps": args.max_steps,
                                     **({} if args.halting_bias is None else {"halting_bias": args.halting_bias})})
    model = LabModel(cfg)
    act = model.body.blocks[0]
    act.aux_weights = {"ponder": args.ponder_weight}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    stream = task.batches(args.batch_size, args.seed)
    t0 = time.perf_counter()
    curve = []
    for step in range(args.steps):
        b = next(stream)
        logits = model(b.inputs, b.key_padding_mask)
        loss = F.cross_entropy(logits, b.targets)
        aux = attnkit.aux_losses(model)
        opt.zero_grad()
        (loss + sum(aux.values())).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            # N + R averaged over real positions (the ponder loss / its weight; with weight 0, from last_info)
            if args.ponder_weight:
                ponder = float(aux["ponder"].detach()) / args.ponder_weight
            else:
                real = b.key_padding_mask if b.key_padding_mask is not None else torch.ones_like(b.inputs, dtype=bool)
                ponder = float(act.last_info.ponder[real].mean())
            curve.append({"step": step + 1, "loss": float(loss.detach()), "ponder": ponder,
                          "act_steps": act.last_mean_steps})
            print(curve[-1], flush=True)
    train_s = time.perf_counter() - t0
    # evaluation by nesting depth, one example at a time (its own steps, no padding)
    model.eval()
    rng = random.Random(10_000 + args.seed)
    by = defaultdict(lambda: {"n": 0, "steps": 0.0, "ponder": 0.0, "correct": 0})
    with torch.no_grad():
        for _ in range(args.eval_examples):
            tree = task.sample_tree(rng)
            ids = torch.tensor([[VOCAB[t] for t in tokens(tree)]])
            pred = int(model(ids).argmax(-1))
            info = act.last_info
            d = by[depth(tree)]
            d["n"] += 1
            d["steps"] += float(info.steps.mean())
            d["ponder"] += float(info.ponder.mean())
            d["correct"] += int(pred == evaluate(tree))
    table = []
    for dep in sorted(by):
        d = by[dep]
        table.append({"depth": dep, "examples": d["n"], "mean_act_steps": d["steps"] / d["n"],
                      "mean_ponder": d["ponder"] / d["n"], "accuracy": d["correct"] / d["n"]})
    up1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    res = {"args": vars(args), "train_s": train_s, "curve": curve, "by_depth": table, "uptime_before": up0,
           "uptime_after": up1, "torch": torch.__version__}
    print("| nesting depth | examples | mean ACT steps N | mean N + R | accuracy |")
    print("|---:|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['depth']} | {r['examples']} | {r['mean_act_steps']:.2f} | {r['mean_ponder']:.2f} | "
              f"{r['accuracy']:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = out / f"act_listops_depth-{stamp}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"train {train_s:.0f} s; wrote {path}")


if __name__ == "__main__":
    main()
