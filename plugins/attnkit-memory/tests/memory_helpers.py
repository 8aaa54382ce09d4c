"""Helpers shared by the memory plugin's tests (imported as ``memory_helpers``)."""

from __future__ import annotations

import torch

import attnkit


def qkv(B=2, H=2, N=11, D=4, E=None, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    E = D if E is None else E
    q, k = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    v = torch.randn(B, H, N, E, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def build(name, dtype=torch.float64, seed=0, **options):
    torch.manual_seed(seed)
    options.setdefault("num_heads", 2)
    options.setdefault("head_dim", 4)
    return attnkit.build(name, **options).to(dtype)


def by_segments(attn, q, k, v, chunk, state=None, **kw):
    """forward(..., causal=True, state=..., return_state=True) segment by segment; (outputs, last state)."""
    outs = []
    for s in range(0, q.shape[2], chunk):
        o, state = attn(q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk], causal=True,
                        state=state, return_state=True, **kw)
        outs.append(o)
    return torch.cat(outs, 2), state
