"""Tensor helpers every mechanism shares: normalisation, the denominator column, chunking, key masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.transforms import chunk_count, symbolic

#: positions per chunk of the chunked torch forms and the kernels, unless ``chunk_size`` says otherwise
DEFAULT_CHUNK = 64


def normalize(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den != 0``; 0 where ``den == 0`` (a query that sees no key); NaN stays NaN.

    Gradients stay finite: the masked branch never divides by 0.
    """
    empty = den == 0
    out = num / torch.where(empty, torch.ones_like(den), den).unsqueeze(-1)
    return out.masked_fill(empty.unsqueeze(-1), 0.0)


def with_ones_column(v: Tensor) -> Tensor:
    """``v`` with a column of ones appended: the denominator rides along with the numerator."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def split_chunks(chunk: int, *xs: Tensor, dynamic: bool = True) -> tuple[int, int, list[Tensor]]:
    """Zero-pad the length (dim 2) to a multiple of ``C = min(chunk, L)`` and split it.

    Each ``(B, H, L, F)`` tensor becomes ``(B, H, N, C, F)``; returns ``(C, N, tensors)``
    (``N = 0`` for an empty sequence). A length ``torch.export`` traces as dynamic
    (:func:`attnkit.transforms.symbolic`) gives ``C = chunk`` and ``N`` from
    :func:`attnkit.transforms.chunk_count`, unless ``dynamic`` is False (a caller that loops over the chunks in
    Python: the export then fixes the length).
    """
    L = xs[0].shape[2]
    dynamic = dynamic and symbolic(L)
    C = max(1, chunk) if dynamic else max(1, min(chunk, L))
    N = chunk_count(L, C) if dynamic else (L + C - 1) // C

    def split(x: Tensor) -> Tensor:
        extra = N * C - x.shape[2]
        x = F.pad(x, (0, 0, 0, extra)) if dynamic or extra else x
        return x.reshape(*x.shape[:2], N, C, x.shape[-1])

    return C, N, [split(x) for x in xs]


def chunk_start_states(ends: Tensor, starts: Tensor, init: Tensor, kv: Tensor, S0: Tensor) -> tuple[Tensor, Tensor]:
    """Every chunk's start state of a decaying recurrence at once, and the final state (no loop over chunks: the
    form a dynamic-length export takes, whose chunk count a Python loop cannot follow).

    The states are held relative to log-scale levels: chunk ``j`` adds ``kv_j`` at level ``ends_j``, chunk ``n``
    starts at level ``starts_n``, ``S0`` is at level ``init``; a state moved from level ``a`` to ``b`` is scaled
    by ``exp(a - b)`` (<= 1: levels never fall). So ``S_n = sum_{j<n} exp(ends_j - starts_n) kv_j +
    exp(init - starts_n) S0`` and the final state is ``S_N`` at level ``ends_{N-1}``. ``O(N^2 K)`` weights and
    ``O(N^2 M F)`` work for ``N`` chunks.

    Args:
        ends, starts: ``(B, H, N, K)`` levels per chunk, ``K`` = ``M`` (a level per feature) or 1 (one for all).
        init: ``(B, H, K)`` the level of ``S0``.
        kv: ``(B, H, N, M, F)`` each chunk's contribution; S0: ``(B, H, M, F)``.

    Returns:
        ``(starts (B, H, N, M, F), final (B, H, M, F))``.
    """
    N = ends.shape[2]
    before = torch.ones(N, N, dtype=torch.bool, device=kv.device).tril(-1)           # [n, j]: j < n
    last = ends[:, :, -1:]                                                            # (B, H, 1, K)
    if ends.shape[-1] == 1:   # one level for every feature: (N, N) weights, one product over M·F
        W = (ends[..., 0].unsqueeze(2) - starts[..., 0].unsqueeze(3)).masked_fill(~before, float("-inf")).exp()
        flat = kv.flatten(-2)
        at_starts = (W @ flat).unflatten(-1, kv.shape[-2:])
        final = (torch.exp(ends[..., 0] - last[..., 0]).unsqueeze(-2) @ flat).squeeze(-2).unflatten(-1, kv.shape[-2:])
    else:
        W = (ends.unsqueeze(2) - starts.unsqueeze(3)).masked_fill(~before[..., None], float("-inf")).exp()
        at_starts = torch.einsum("bhnjm,bhjmf->bhnmf", W, kv)
        final = torch.einsum("bhjm,bhjmf->bhmf", torch.exp(ends - last), kv)
    at_starts = at_starts + torch.exp(init.unsqueeze(2) - starts).unsqueeze(-1) * S0.unsqueeze(2)
    final = final + torch.exp(init - last[:, :, 0]).unsqueeze(-1) * S0
    return at_starts, final


def padded(key_padding_mask: Tensor | None) -> Tensor | None:
    """``(B, 1, S, 1)`` bool, True at padded keys (from a ``(B, S)`` mask, True = real), or None."""
    return None if key_padding_mask is None else ~key_padding_mask[:, None, :, None]


def zero_padded(x: Tensor, pad: Tensor | None) -> Tensor:
    """``x (B, H, S, F)`` with the rows of padded keys set to 0 (``masked_fill``: Inf and NaN there go too)."""
    return x if pad is None else x.masked_fill(pad, 0.0)
