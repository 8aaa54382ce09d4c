"""The plain streaming reference of ``compressive``: segments fed one by one, memories kept as Python lists.

Each segment attends, with the explicit-gather four-term attention of
:mod:`attnkit_memory.transformer_xl.naive`, to ``[compressed | memory |
segment]`` (distances along the concatenation); then positions are moved
one by one from the memory to an eviction list while the memory holds more
than ``mem_len`` and at least ``c`` can go, and each group of ``c`` evicted
positions is compressed with a loop (pooling, the module's convolution
weights, or the most attended positions). No shift, no batched eviction.
(Single call, no memory: the spec's reference is Transformer-XL's.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..transformer_xl.naive import four_term_attention


def _compress_group(attn: Any, ks: list[Tensor], vs: list[Tensor]) -> tuple[Tensor, Tensor]:
    """One slot from c positions, each ``(B, H, D)`` / ``(B, H, E)`` (no padding in the streaming reference)."""
    K, V = torch.stack(ks, 2), torch.stack(vs, 2)              # (B, H, c, ·)
    if attn.compression == "mean":
        return K.mean(2), V.mean(2)
    if attn.compression == "max":
        return K.max(2).values, V.max(2).values
    # conv: out_o = sum_t sum_i W[o, t, i] x_t,i
    ck = sum(K[:, :, t] @ attn.conv_k[:, t, :].T for t in range(attn.rate))
    cv = sum(V[:, :, t] @ attn.conv_v[:, t, :].T for t in range(attn.rate))
    return ck, cv


def segment_reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, chunk: int) -> Tensor:
    """``(B, H, N, E)``: the sequence fed in segments of ``chunk`` (see the module docs)."""
    N = q.shape[2]
    mem: list[tuple[Tensor, Tensor, Tensor]] = []      # (k_t, v_t, usage_t (B,)) oldest first
    cmem: list[tuple[Tensor, Tensor]] = []
    outs = []
    for a in range(0, N, chunk):
        qs, ks, vs = q[:, :, a:a + chunk], k[:, :, a:a + chunk], v[:, :, a:a + chunk]
        L = qs.shape[2]
        K = torch.cat([torch.stack([c[0] for c in cmem] + [m[0] for m in mem], 2), ks] if cmem or mem else [ks], 2)
        V = torch.cat([torch.stack([c[1] for c in cmem] + [m[1] for m in mem], 2), vs] if cmem or mem else [vs], 2)
        T = K.shape[2]
        dist = torch.tensor([[T - L + i - j for j in range(T)] for i in range(L)], device=q.device)
        out, w = four_term_attention(attn, qs, K, V, dist, dist >= 0, attn.get_scale(q), with_weights=True)
        outs.append(out)
        received = w.sum(dim=(1, 2))                   # (B, T)
        base = len(cmem)
        mem = [(mk, mv, u + received[:, base + n]) for n, (mk, mv, u) in enumerate(mem)]
        mem += [(ks[:, :, t], vs[:, :, t], received[:, base + len(mem) + t]) for t in range(L)]
        evicted = []
        while len(mem) - len(evicted) > attn.mem_len and len(mem) - attn.mem_len >= len(evicted) + attn.rate:
            evicted.extend(mem[len(evicted):len(evicted) + attn.rate])
        mem = mem[len(evicted):]
        for g in range(0, len(evicted), attn.rate):
            group = evicted[g:g + attn.rate]
            if attn.compression == "most_used":
                continue
            cmem.append(_compress_group(attn, [e[0] for e in group], [e[1] for e in group]))
        if attn.compression == "most_used" and evicted:
            keep = len(evicted) // attn.rate
            B = q.shape[0]
            chosen = []
            for b in range(B):
                order = sorted(range(len(evicted)), key=lambda i: (-float(evicted[i][2][b].detach()), i))[:keep]
                chosen.append(sorted(order))
            for s in range(keep):
                cmem.append((torch.stack([evicted[chosen[b][s]][0][b] for b in range(B)]),
                             torch.stack([evicted[chosen[b][s]][1][b] for b in range(B)])))
        cmem = cmem[max(0, len(cmem) - attn.cmem_len):]
    return torch.cat(outs, 2)
