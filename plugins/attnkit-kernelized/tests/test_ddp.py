"""``rfa`` (both forms) and ``fast-weight`` under DistributedDataParallel: 2 processes, gloo, CPU.

DDP all-reduces the gradient of every parameter; one that the forward pass
did not use makes the second step fail ("Expected to have finished reduction
in the prior iteration"). The non-causal form of rfa is ungated, so its gate
parameters used to be unused there. Each worker trains a few steps of every
configuration (one process group, spawned once) and the parameters must agree
across the two processes afterwards (the gradients were averaged). rfa runs
its positive feature map here: the trig map's denominator can vanish on
random data, and a few SGD steps then reach NaN on their own.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3
CONFIGS = [("rfa", {"num_features": 4, "seed": 0, "feature_map": "positive"}, False),
           ("rfa", {"num_features": 4, "seed": 0, "feature_map": "positive"}, True),
           ("rfa", {"num_features": 4, "seed": 0, "feature_map": "positive", "gate": False}, False),
           ("rfa", {"num_features": 4, "seed": 0, "feature_map": "positive", "gate": False}, True),
           ("fast-weight", {}, True)]


def _worker(rank: int, world: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    # a file rendezvous: no port to race for with other jobs on the machine
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP

        import attnkit

        out = []
        for name, options, causal in CONFIGS:
            torch.manual_seed(0)
            attn = attnkit.build(name, num_heads=2, head_dim=4, **options)
            model = DDP(attn)                                 # find_unused_parameters=False: the default
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(100 + rank)     # each rank its own data
            try:
                for _ in range(STEPS):
                    q, k, v = (torch.randn(2, 2, 7, 4, generator=g) for _ in range(3))
                    loss = model(q, k, v, causal=causal).square().mean()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                out.append(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
                break
            flat = torch.cat([p.detach().reshape(-1) for p in attn.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            out.append(("ok", [t.tolist() for t in gathered]))
        if rank == 0:
            results.put(out)
    finally:
        # both ranks done before either tears the group down: a rank that closes its pairs while the other
        # still talks kills that one with 'terminate called without an active exception' (SIGABRT)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        dist.destroy_process_group()


def test_ddp_trains_every_form_on_two_processes(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(2, str(tmp_path / "rendezvous"), results), nprocs=2, join=True,
                       start_method="spawn")
    outcomes = results.get(timeout=60)
    assert len(outcomes) == len(CONFIGS), outcomes[-1]
    for (name, options, causal), (status, payload) in zip(CONFIGS, outcomes):
        assert status == "ok", (name, options, causal, payload)
        a, b = (torch.tensor(p) for p in payload)
        assert torch.isfinite(a).all(), (name, options, causal)
        assert torch.equal(a, b), f"{name} {options} causal={causal}: the processes' parameters differ after DDP"
