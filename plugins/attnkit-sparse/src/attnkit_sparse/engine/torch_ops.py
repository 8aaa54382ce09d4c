"""The ``torch`` backend: a readable, vectorised block-gather implementation (any device, autograd).

For each query block, the key and value blocks the plan visits are gathered
(padded to the largest count, with a validity mask), scores are computed per
tile, FULL tiles are kept whole, PARTIAL tiles take their element mask from
the plan's bank, and a stable softmax runs over the gathered keys. Memory is
proportional to the attended tiles: ``B·H·NQ·CK·BK·(D + E)`` for the gathered
blocks and ``B·H·NQ·BQ·CK·BK`` for the scores, never ``(L, S)`` (unless the
mask is dense). Autograd differentiates through the gathers.

float16 and bfloat16 inputs are widened to float32 where the blocks are
gathered: scores, softmax and the weighted sum of values run in float32, the
output is cast back to the input dtype (its gradients arrive in the input
dtype through the casts) and the log-sum-exp stays float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.masks import Geometry, Mask

from .plan import FULL_TILE, BlockPlan

__all__ = ["attend"]


def _blocks(x: Tensor, n: int, block: int) -> Tensor:
    """``(B, H, N, F)`` zero-padded to ``n * block`` rows -> ``(B, H, n, block, F)``."""
    pad = n * block - x.shape[-2]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.view(*x.shape[:2], n, block, x.shape[-1])


def attend(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float, *,
           return_lse: bool = False, extra: Mask | None = None,
           geometry: Geometry | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse ``softmax(scale · q kᵀ masked) v`` over the tiles of ``plan``.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``.
        plan: the :class:`~attnkit_sparse.engine.plan.BlockPlan` for this shape.
        scale: multiplier of ``q · k``.
        extra: optional mask applied on top of the plan's, evaluated at every gathered (query, key) pair: the
            parts of a mask that the plan was not built from (masks among the inputs of a ``torch.export``
            trace, whose values a plan cannot read: key padding, tensors, documents). Needs ``geometry``.
        geometry: the :class:`attnkit.masks.Geometry` of the call (with ``extra``).

    Returns:
        ``(B, H, L, E)`` in the input dtype; rows with no allowed key are 0 (finite gradients). With
        ``return_lse`` also the log-sum-exp ``(B, H, L)`` of the scaled scores per row (``+inf`` for a row
        with no key; float32 for half inputs, computed in float32 like the scores).
    """
    B, H, L, D = q.shape
    S, E = k.shape[-2], v.shape[-1]
    bq, bk = plan.block_size
    nq, nk = plan.num_blocks
    dev = q.device
    dtype = q.dtype
    # half inputs: float32 from the gather on (the gathered copies, the scores, the softmax, the sum)
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    qb = _blocks(q, nq, bq).to(wide)                                 # (B, H, NQ, BQ, D)
    kb, vb = _blocks(k, nk, bk), _blocks(v, nk, bk)                  # (B, H, NK, BK, *)
    cw = plan.kv_idx.shape[-1]
    idx = plan.kv_idx.long().expand(B, H, nq, cw)                    # (B, H, NQ, CK)
    tile = plan.kv_tile.long().expand(B, H, nq, cw)
    flat = idx.reshape(B, H, nq * cw, 1, 1)
    kg = kb.gather(2, flat.expand(B, H, nq * cw, bk, D)).view(B, H, nq, cw, bk, D).to(wide)
    vg = vb.gather(2, flat.expand(B, H, nq * cw, bk, E)).view(B, H, nq, cw, bk, E).to(wide)
    scores = torch.einsum("bhnqd,bhnckd->bhnqck", qb, kg) * scale     # (B, H, NQ, BQ, CK, BK)
    # element mask per tile: FULL -> all, PARTIAL -> bank entry, padding -> none; keys past S never
    P = plan.bank.shape[0]
    bank = torch.cat([plan.bank, torch.ones(1, bq, bk, dtype=torch.bool, device=dev),
                      torch.zeros(1, bq, bk, dtype=torch.bool, device=dev)])
    which = torch.where(tile >= 0, tile, torch.where(tile == FULL_TILE, P, P + 1))
    keep = bank[which]                                               # (B, H, NQ, CK, BQ, BK)
    key_in = (idx.unsqueeze(-1) * bk + torch.arange(bk, device=dev)) < S   # (B, H, NQ, CK, BK)
    keep = (keep & key_in.unsqueeze(-2)).permute(0, 1, 2, 4, 3, 5)   # (B, H, NQ, BQ, CK, BK)
    if extra is not None:   # evaluated at the gathered pairs (indices past L or S clamped: those pairs are masked)
        ar = torch.arange
        qi = (ar(nq, device=dev)[:, None] * bq + ar(bq, device=dev)).clamp(max=L - 1).view(1, 1, nq, bq, 1, 1)
        ki = (idx.unsqueeze(-1) * bk + ar(bk, device=dev)).clamp(max=S - 1).view(B, H, nq, 1, cw, bk)
        keep = keep & extra._keep(ar(B, device=dev).view(B, 1, 1, 1, 1, 1), ar(H, device=dev).view(1, H, 1, 1, 1, 1),
                                  qi, ki, geometry)
    scores = scores.masked_fill(~keep, float("-inf")).flatten(-2)
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(scores - m)                                        # 0 where masked
    den = p.sum(-1, keepdim=True)
    p = p / torch.where(den > 0, den, torch.ones_like(den))
    out = torch.einsum("bhnqj,bhnje->bhnqe", p, vg.flatten(3, 4))    # (B, H, NQ, BQ, E)
    out = out.reshape(B, H, nq * bq, E)[:, :, :L].to(dtype)
    if not return_lse:
        return out
    has = den > 0
    lse = torch.where(has, m + torch.log(torch.where(has, den, torch.ones_like(den))),
                      torch.full_like(den, float("inf")))
    return out, lse.reshape(B, H, nq * bq)[:, :, :L]
