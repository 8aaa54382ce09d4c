"""Plain references of ``memory-tokens``: one explicit softmax per query row, slots updated in a loop."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask


def _row_softmax(s: Tensor, keep: Tensor) -> Tensor:
    s = torch.where(keep, s, torch.full_like(s, float("-inf")))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.where(keep, (s - m).exp(), torch.zeros_like(s))
    den = w.sum(-1, keepdim=True)
    return w / torch.where(den > 0, den, torch.ones_like(den))


def _read(attn: Any, q: Tensor, k: Tensor, v: Tensor, mk: Tensor, mv: Tensor, keep_seg: Tensor) -> Tensor:
    """Segment queries over [slots | keys]: slots always visible, keys where ``keep_seg`` (B', H', L, S)."""
    B, H, L, _ = q.shape
    N = mk.shape[2]
    scale = attn.get_scale(q)
    s_mem = torch.einsum("bhld,bhnd->bhln", q, mk) * scale
    s_seg = torch.einsum("bhld,bhsd->bhls", q, k) * scale
    keep = torch.cat([torch.ones(B, H, L, N, dtype=torch.bool, device=q.device),
                      keep_seg.expand(B, H, L, k.shape[2])], -1)
    w = _row_softmax(torch.cat([s_mem, s_seg], -1), keep)
    out = w[..., :N] @ mv + w[..., N:] @ v
    sees = keep[..., N:].any(-1, keepdim=True)
    return torch.where(sees, out, torch.zeros_like(out))


def reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None,
              positions: Any = None) -> Tensor:
    """One call without state: reads the initial slots. Returns ``(B, H, L, E)``."""
    B, H, L, _ = q.shape
    S = k.shape[2]
    keep = torch.arange(S, device=q.device)[None, :] <= (S - L) + torch.arange(L, device=q.device)[:, None]
    keep = keep[None, None]
    if mask is not None:
        keep = keep & mask.dense(Geometry(B, H, L, S, q.device, positions))
        kpm = mask.key_padding_mask
        if kpm is not None:
            pad = ~kpm[:, None, :, None]
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    mk = attn.mem_k[None].expand(B, -1, -1, -1)
    mv = v.new_zeros(B, H, attn.num_memory, v.shape[-1])
    return _read(attn, q, k, v, mk, mv, keep)


def segment_reference(attn: Any, q: Tensor, k: Tensor, v: Tensor, chunk: int) -> Tensor:
    """The sequence in segments of ``chunk``: read, then write each slot with its own attention row."""
    B, H, Ntot, _ = q.shape
    mk = attn.mem_k[None].expand(B, -1, -1, -1)
    mv = v.new_zeros(B, H, attn.num_memory, v.shape[-1])
    scale = attn.get_scale(q)
    outs = []
    for a in range(0, Ntot, chunk):
        qs, ks, vs = q[:, :, a:a + chunk], k[:, :, a:a + chunk], v[:, :, a:a + chunk]
        L = qs.shape[2]
        keep = torch.arange(L, device=q.device)[None, :] <= torch.arange(L, device=q.device)[:, None]
        outs.append(_read(attn, qs, ks, vs, mk, mv, keep[None, None]))
        new_k, new_v = [], []
        for n in range(attn.num_memory):                     # slot n writes: its query over [slots | segment]
            qn = mk[:, :, n] @ attn.w_q                       # (B, H, D)
            s = torch.cat([torch.einsum("bhd,bhmd->bhm", qn, mk), torch.einsum("bhd,bhsd->bhs", qn, ks)], -1)
            w = torch.softmax(s * scale, -1)
            ok = torch.einsum("bhm,bhmd->bhd", w, torch.cat([mk, ks], 2))
            ov = torch.einsum("bhm,bhme->bhe", w, torch.cat([mv, vs], 2))
            new_k.append(torch.einsum("bhd,hdf->bhf", ok, attn.w_k))
            new_v.append(ov)
        mk, mv = torch.stack(new_k, 2), torch.stack(new_v, 2)
    return torch.cat(outs, 2)
