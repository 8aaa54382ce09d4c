"""Training with segment state under DistributedDataParallel: 2 processes, gloo, CPU.

A tiny language-model body with ``transformer-xl`` attention (and with
``compressive``, whose convolution is trained by the attention-reconstruction
auxiliary loss added to the task loss) is trained for a few steps; every step
feeds each rank's windows in segments, carrying the attention state across
segments and across steps (the memory detached, as in Transformer-XL). DDP
averages the gradients, so after training both ranks hold the same
parameters, equal to one process trained on both ranks' batches (same carried
states), in float64. Skipped unless ``attnkit_memory`` is importable.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import attnkit

pytest.importorskip("attnkit_memory", reason="attnkit-memory is not installed")

VOCAB, DIM, HEADS, SEG, WINDOW, BATCH, STEPS = 13, 8, 2, 3, 9, 2, 3
ATTENTIONS = {
    "transformer-xl": {"mem_len": 4},
    "compressive": {"mem_len": 2, "cmem_len": 2, "compression_rate": 2, "compression": "conv"},
}


class SegmentLM(nn.Module):
    """Embedding, a one-block Transformer with transformer-xl, a head; one forward = all segments of a window."""

    def __init__(self, attention: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = attnkit.Transformer(DIM, 1, HEADS, attention=attention, mlp_ratio=2.0,
                                        attention_options=ATTENTIONS[attention])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, state):
        outs = []
        for s in range(0, tokens.shape[1], SEG):
            x, state = self.body(self.embed(tokens[:, s:s + SEG]), causal=True, state=state, return_state=True)
            outs.append(self.head(x))
        return torch.cat(outs, 1), state


def data(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (BATCH, WINDOW + 1), generator=g) for _ in range(STEPS)]


def train(model, batches, step_fn) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    state, losses = None, []
    for win in batches:
        logits, state = model(win[:, :-1], state)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), win[:, 1:].reshape(-1))
        aux = attnkit.aux_losses(model)
        if aux:
            loss = loss + sum(aux.values())
        opt.zero_grad()
        loss.backward()
        step_fn()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _worker(rank: int, world: int, init_file: str, out_dir: str, attention: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = SegmentLM(attention).double()
        ddp = nn.parallel.DistributedDataParallel(model)
        losses = train(ddp, data(rank), lambda: None)
        torch.save({"params": {n: p.detach() for n, p in model.named_parameters()}, "losses": losses},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        # both ranks done before either tears the group down: a rank that closes its pairs while the other
        # still talks kills that one with 'terminate called without an active exception' (SIGABRT)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        dist.destroy_process_group()


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_ddp_training_with_segment_state(tmp_path, attention):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), attention), nprocs=2, join=True)
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    for name, p in r0["params"].items():
        torch.testing.assert_close(p, r1["params"][name], atol=0, rtol=0, msg=f"ranks disagree on {name}")

    # one process on both ranks' batches: the per-rank states are per-sample, so the concatenated batch
    # carries the same memories; the mean loss over 2B equals the mean of the ranks' mean losses
    torch.manual_seed(0)
    single = SegmentLM(attention).double()
    both = [torch.cat([a, b]) for a, b in zip(data(0), data(1))]
    losses = train(single, both, lambda: None)
    for name, p in single.named_parameters():
        torch.testing.assert_close(r0["params"][name], p.detach(), atol=1e-10, rtol=1e-8,
                                   msg=f"DDP and single-process training disagree on {name}")
    assert all(torch.isfinite(torch.tensor(r0["losses"] + losses)))
    torch.manual_seed(0)
    first = dict(SegmentLM(attention).double().named_parameters())
    assert any(not torch.equal(first[n], p) for n, p in r0["params"].items())  # training moved the weights
