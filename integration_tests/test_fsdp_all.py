"""FSDP2 (``fully_shard``): one training step of a small Transformer per registered attention, 2 gloo ranks, CPU.

Every registered attention (read at collection time, so new mechanisms and
families are covered by construction) is put in a two-block :class:`attnkit.Transformer` (width 16, 2 heads, float64,
``torch.manual_seed(0)``); each block and then the root are sharded with
``torch.distributed.fsdp.fully_shard`` across two gloo ranks; each rank takes
one SGD step on its half of a global batch. The gathered parameters
(``DTensor.full_tensor()``) must equal those of one unsharded process that
took the step on the whole batch (float64, atol 1e-10), and the step must have
moved them. One pair of spawned processes loops over every name. Mechanisms that draw noise per
batch element in training step in eval mode (as in ``test_ddp_all.py``); routing all-reduces its
centroid statistics (``sync_centroids=True``).
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import attnkit

DIM, HEADS, DEPTH, L, BATCH_PER_RANK, WORLD = 16, 2, 2, 8, 2, 2

NAMES = [s.name for s in attnkit.available()]
FAMILIES = sorted({s.family for s in attnkit.available()})
#: stochastic per batch element in training (like dropout): stepped in eval mode
TRAINING_NOISE = {"sinkhorn"}
OPTIONS = {"routing": {"sync_centroids": True}}


def build(name: str) -> tuple[nn.Module, bool]:
    torch.manual_seed(0)
    causal = not attnkit.get_spec(name).capabilities.noncausal
    model = attnkit.Transformer(DIM, depth=DEPTH, num_heads=HEADS, attention=name,
                                attention_options=OPTIONS.get(name)).double()
    return (model.eval() if name in TRAINING_NOISE else model.train()), causal


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(WORLD * BATCH_PER_RANK, L, DIM, generator=g, dtype=torch.float64)
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, causal: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = ((model(x, causal=causal) - y) ** 2).mean()
    aux = attnkit.aux_losses(model)
    (loss + sum(aux.values()) if aux else loss).backward()
    opt.step()


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    results: dict[str, dict] = {}
    try:
        x, y = batch()
        part = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        for name in NAMES:
            try:
                model, causal = build(name)
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
                one_step(model, x[part], y[part], causal)
                results[name] = {"params": {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor")
                                            else p.detach().clone() for n, p in model.named_parameters()}}
            except Exception as exc:  # noqa: BLE001 - reported per name by the test
                results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        # both ranks done before either tears the group down: a rank that closes its pairs while the other
        # still talks kills that one with 'terminate called without an active exception' (SIGABRT)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(str(out / "init"), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_every_family_is_covered():
    assert {attnkit.get_spec(n).family for n in NAMES} == set(FAMILIES) and "core" in FAMILIES


@pytest.mark.parametrize("name", NAMES)
def test_fully_shard_step_equals_the_unsharded_step(fsdp_results, name):
    for r, res in enumerate(fsdp_results):
        assert "error" not in res[name], f"{name} on rank {r} under fully_shard: {res[name]['error']}"
    x, y = batch()
    model, causal = build(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    one_step(model, x, y, causal)
    moved = False
    for n, p in model.named_parameters():
        for r, res in enumerate(fsdp_results):
            torch.testing.assert_close(res[name]["params"][n], p.detach(), atol=1e-10, rtol=1e-8,
                                       msg=f"{name}: parameter {n} on rank {r} after the sharded step "
                                           f"differs from the unsharded step on the global batch")
        moved |= not torch.equal(before[n], p.detach())
    assert moved, f"{name}: the step moved no parameter"
