"""FSDP2 (``fully_shard``): one training step of a small Transformer per registered family, 2 gloo ranks, CPU.

For each family in the registry (read at collection time, so new families are
covered by construction) the first registered attention of that family is put
in a two-block :class:`attnkit.Transformer` (width 16, 2 heads, float64,
``torch.manual_seed(0)``); each block and then the root are sharded with
``torch.distributed.fsdp.fully_shard`` across two gloo ranks; each rank takes
one SGD step on its half of a global batch. The gathered parameters
(``DTensor.full_tensor()``) must equal those of one unsharded process that
took the step on the whole batch (float64, atol 1e-10), and the step must have
moved them. One pair of spawned processes loops over every family.
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

FAMILIES: dict[str, str] = {}
for _spec in attnkit.available():
    FAMILIES.setdefault(_spec.family, _spec.name)


def build(name: str) -> tuple[nn.Module, bool]:
    torch.manual_seed(0)
    causal = not attnkit.get_spec(name).capabilities.noncausal
    return attnkit.Transformer(DIM, depth=DEPTH, num_heads=HEADS, attention=name).double().train(), causal


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
        for family, name in FAMILIES.items():
            try:
                model, causal = build(name)
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
                one_step(model, x[part], y[part], causal)
                results[family] = {"params": {n: p.full_tensor().detach().clone() if hasattr(p, "full_tensor")
                                              else p.detach().clone() for n, p in model.named_parameters()}}
            except Exception as exc:  # noqa: BLE001 - reported per family by the test
                results[family] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
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
    assert {s.family for s in attnkit.available()} == set(FAMILIES) and "core" in FAMILIES


@pytest.mark.parametrize("family", list(FAMILIES), ids=[f"{f}:{n}" for f, n in FAMILIES.items()])
def test_fully_shard_step_equals_the_unsharded_step(fsdp_results, family):
    name = FAMILIES[family]
    for r, res in enumerate(fsdp_results):
        assert "error" not in res[family], f"{family} ({name}) on rank {r} under fully_shard: {res[family]['error']}"
    x, y = batch()
    model, causal = build(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    one_step(model, x, y, causal)
    moved = False
    for n, p in model.named_parameters():
        for r, res in enumerate(fsdp_results):
            torch.testing.assert_close(res[family]["params"][n], p.detach(), atol=1e-10, rtol=1e-8,
                                       msg=f"{family} ({name}): parameter {n} on rank {r} after the sharded step "
                                           f"differs from the unsharded step on the global batch")
        moved |= not torch.equal(before[n], p.detach())
    assert moved, f"{family} ({name}): the step moved no parameter"
