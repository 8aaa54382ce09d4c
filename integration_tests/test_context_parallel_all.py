"""Context parallelism over every registered attention: 2 and 4 gloo ranks, CPU, float64.

Names whose spec sets ``Capabilities.context_parallel`` must equal one process
on outputs, input gradients and parameter gradients (uneven chunks, NaN/Inf in
padded keys and values); every other name must refuse with
:class:`attnkit.UnsupportedFeatureError` naming the implementations that can
run split. The names are read from the registry at collection time, so a
mechanism that arrives later is covered by construction.
"""

from __future__ import annotations

import pytest

import attnkit
from attnkit.testing.context_parallel import run_cases

H, D = 2, 8
NAMES = sorted(s.name for s in attnkit.available())
SPLIT = sorted(s.name for s in attnkit.available(context_parallel=True))
#: small options for the split forms (feature counts), the rest build with their defaults
OPTIONS = {"performer": {"num_features": 16, "seed": 0}, "rfa": {"num_features": 8, "seed": 0},
           "local": {"window": 5}}


def test_the_split_forms_are_registered():
    assert {"linear", "performer", "rfa", "fast-weight", "local"} <= set(SPLIT)


@pytest.mark.parametrize("world,lengths", [(2, [4, 5]), (4, [3, 1, 4, 2])])
def test_every_name_splits_or_refuses(world, lengths):
    cases = [(n, {"num_heads": H, "head_dim": D, **OPTIONS.get(n, {})}) for n in NAMES]
    results = run_cases(cases, world=world, lengths=lengths, shape=(2, H, D, D))
    problems = []
    for name, res in zip(NAMES, results):
        if name in SPLIT:
            if res.status != "ok":
                problems.append(str(res))
        elif res.status != "refused" or "context parallelism" not in res.message or "local" not in res.message:
            problems.append(f"{name} should refuse naming the split forms: {res}")
    assert not problems, "\n".join(problems)


def _model_worker(rank: int, world: int, init_file: str, outdir: str) -> None:
    import datetime
    import json
    import os

    import torch
    import torch.distributed as dist

    from attnkit.context_parallel import chunk_bounds, sequence_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    res = {}
    try:
        for name in ("linear", "local"):
            torch.manual_seed(0)
            model = attnkit.Transformer(16, depth=2, num_heads=2, attention=name,
                                        attention_options=OPTIONS.get(name, {})).double()
            g = torch.Generator().manual_seed(1)
            x = torch.randn(2, 13, 16, generator=g, dtype=torch.float64)
            target = torch.randn(2, 13, 16, generator=g, dtype=torch.float64)
            kpm = torch.ones(2, 13, dtype=torch.bool)
            kpm[1, 5:8] = False
            start, stop = chunk_bounds(13, world)[rank]
            with sequence_parallel():
                out = model(x[:, start:stop], causal=True, key_padding_mask=kpm[:, start:stop])
            ((out - target[:, start:stop]) ** 2).sum().backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(grads)
            model.zero_grad()
            ref = model(x, causal=True, key_padding_mask=kpm)
            ((ref - target) ** 2).sum().backward()
            ref_grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            res[name] = [float((out - ref[:, start:stop]).abs().max()), float((grads - ref_grads).abs().max())]
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
            json.dump(res, fh)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        dist.destroy_process_group()


def test_a_whole_transformer_runs_split_inside_sequence_parallel(tmp_path):
    """Embedding-free two-block Transformers (linear, local) with each rank holding its chunk of x: outputs
    and parameter gradients (summed over ranks) equal one process on the whole sequence."""
    import json

    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_model_worker, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world)
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(res) == {"linear", "local"}
        for name, (out_err, grad_err) in res.items():
            assert out_err < 1e-10 and grad_err < 1e-9, (r, name, out_err, grad_err)
