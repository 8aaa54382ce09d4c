"""Tensor helpers every mechanism shares: normalisation, the denominator column, chunking, the chunk start states
of a dynamic-length program, key masks."""

from __future__ import annotations

import torch
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


def split_chunks(chunk: int, *xs: Tensor, dynamic: bool = True, group: int = 1) -> tuple[int, int, list[Tensor]]:
    """Zero-pad the length (dim 2) to a multiple of ``C = min(chunk, L)`` and split it.

    Each ``(B, H, L, F)`` tensor becomes ``(B, H, N, C, F)``; returns ``(C, N, tensors)``
    (``N = 0`` for an empty sequence). A length ``torch.export`` traces as dynamic
    (:func:`attnkit.transforms.symbolic`) gives ``C = chunk`` and ``N`` from
    :func:`attnkit.transforms.chunk_count`, a multiple of ``group`` there (the chunk count
    :func:`chunk_outputs` takes, the whole groups of ``group · C`` positions), unless ``dynamic`` is False
    (a caller that loops over the chunks in Python: the export then fixes the length).
    """
    L = xs[0].shape[2]
    dynamic = dynamic and symbolic(L)
    C = max(1, chunk) if dynamic else max(1, min(chunk, L))
    N = group_chunk_count(L, C, group) if dynamic else (L + C - 1) // C

    def split(x: Tensor) -> Tensor:
        extra = N * C - x.shape[2]
        x = pad_length(x, extra) if dynamic or extra else x
        return x.reshape(*x.shape[:2], N, C, x.shape[-1])

    return C, N, [split(x) for x in xs]


def pad_length(x: Tensor, extra: int | torch.SymInt, fill: float = 0.0) -> Tensor:
    """``x (B, H, L, F)`` with ``extra`` positions of ``fill`` after its last (dim 2), by a concatenation:
    ``F.pad``'s kernel reads its widths as concrete integers, which fails in a dynamic-length program's
    ``torch.cond`` branch run with autograd (the branch is traced again there)."""
    return torch.cat([x, x.new_full((*x.shape[:2], extra, x.shape[-1]), fill)], dim=2)


#: chunks per group of :func:`chunk_outputs` (a dynamic-length program's chunk count is a multiple of it)
START_GROUP = 8


def group_chunk_count(L: torch.SymInt, C: int, group: int = START_GROUP) -> torch.SymInt:
    """The chunk count of a dynamic length ``L`` in chunks of ``C``, padded to whole groups of ``group`` chunks:
    ``group · ceil(L / (group · C))`` from :func:`attnkit.transforms.chunk_count`, so :func:`chunk_outputs`
    splits it into its groups without a guard (``group = 1``: the plain chunk count)."""
    return chunk_count(L, C * group) * group if group > 1 else chunk_count(L, C)


def chunk_outputs(ends: Tensor, init: Tensor, kv: Tensor, S0: Tensor, q: Tensor, intra: Tensor, *,
                  group: int = START_GROUP) -> tuple[Tensor, Tensor]:
    """Every chunk's output ``intra_n + q_n S_n`` from its start state ``S_n`` of a decaying recurrence, and the
    final state, without a Python loop over the chunks (the form a dynamic-length export takes, whose chunk count
    such a loop cannot follow).

    The states are held relative to log-scale levels that never fall: chunk ``j`` adds ``kv_j`` at level
    ``ends_j``, chunk ``n`` starts at the level the chunk before it ended at (``ends_{n-1}``; ``init``, the level
    of ``S0``, for the first); a state moved from level ``a`` to ``b >= a`` is scaled by ``exp(a - b) <= 1``:
    ``S_{n+1} = exp(ends_{n-1} - ends_n) S_n + kv_n``, and the final state is ``S_N`` at level ``ends_{N-1}``.

    Two levels, ``G = group`` chunks a group (``N`` a multiple of ``G``: :func:`group_chunk_count`): each group's
    total from zero (the recurrence over its ``G`` chunks, every group at once), the groups' start states in
    closed form over those totals (``(N/G + 1) x N/G`` weights: ``S_g = sum_{h<g} exp(end_h - end_{g-1})
    total_h + exp(init - end_{g-1}) S0``), then the recurrence again inside every group from its start state,
    each chunk's output taken on the way. ``O(N M F + (N/G)^2 M F)`` work, and no ``(N, M, F)`` tensor of every
    start state. (The closed form over every pair of chunks, ``O(N^2 M F)`` with ``(N, N, M)`` weights and every
    start state written out, took about a third of a dynamic causal performer program at L = 4,096, 64 chunks,
    M = 256: ~140 of 400 ms in a profile; this form, the product with the queries included, ~40 ms.) Every
    factor is ``exp`` of a level difference <= 0, as in the sequential form.

    Args:
        ends: ``(B, H, N, K)`` each chunk's end level, ``K`` = ``M`` (a level per feature) or 1 (one for all).
        init: ``(B, H, K)`` the level of ``S0``.
        kv: ``(B, H, N, M, F)`` each chunk's contribution; S0: ``(B, H, M, F)``.
        q: ``(B, H, N, C, M)`` the chunks' query factors of the start states; intra: ``(B, H, N, C, F)``.
        group: chunks per group; ``N`` must be a multiple of it.

    Returns:
        ``(out (B, H, N, C, F), final (B, H, M, F))``.
    """
    B, H, N, K = ends.shape
    M, Fd = kv.shape[-2:]
    C = q.shape[-2]
    G = max(1, group)
    P = N // G
    e = ends.reshape(B, H, P, G, K)
    x = kv.reshape(B, H, P, G, M, Fd)
    group_end = e[:, :, :, -1]                                                        # (B, H, P, K)
    levels = torch.cat([init.unsqueeze(2), group_end], dim=2)                         # (B, H, P+1, K)
    at = torch.cat([levels[:, :, :P, None], e[:, :, :, :-1]], dim=3)                   # each chunk's start level
    step = torch.exp(at - e).unsqueeze(-1).unbind(3)                                  # G x (B, H, P, K, 1), <= 1
    xs = x.unbind(3)                                                                  # G x (B, H, P, M, F)
    total = xs[0]                          # each group's total at its end level, from zero at its start
    for i in range(1, G):
        total = xs[i] + step[i] * total
    # across groups: group g starts at levels[g] from the totals of the groups before it; levels[P] is the end
    before = torch.ones(P + 1, P, dtype=torch.bool, device=kv.device).tril(-1)        # [g, h]: h < g
    W = (group_end.unsqueeze(2) - levels.unsqueeze(3)).masked_fill(~before[..., None], float("-inf")).exp()
    if K == 1:   # one level for every feature: ((P+1) x P) weights, one product over M·F
        starts = (W[..., 0] @ total.flatten(-2)).unflatten(-1, (M, Fd))
    else:
        starts = torch.einsum("bhgpm,bhpmf->bhgmf", W, total)
    starts = starts + torch.exp(init.unsqueeze(2) - levels).unsqueeze(-1) * S0.unsqueeze(2)   # (B, H, P+1, M, F)
    qs = q.reshape(B, H, P, G, C, M).unbind(3)
    ins = intra.reshape(B, H, P, G, C, Fd).unbind(3)
    S = starts[:, :, :P]
    outs = []
    for i in range(G):      # inside every group from its start state
        outs.append(torch.matmul(qs[i], S) + ins[i])                                  # (B, H, P, C, F)
        if i < G - 1:
            S = xs[i] + step[i] * S
    return torch.stack(outs, dim=3).reshape(B, H, N, C, Fd), starts[:, :, -1]


def padded(key_padding_mask: Tensor | None) -> Tensor | None:
    """``(B, 1, S, 1)`` bool, True at padded keys (from a ``(B, S)`` mask, True = real), or None."""
    return None if key_padding_mask is None else ~key_padding_mask[:, None, :, None]


def zero_padded(x: Tensor, pad: Tensor | None) -> Tensor:
    """``x (B, H, S, F)`` with the rows of padded keys set to 0 (``masked_fill``: Inf and NaN there go too)."""
    return x if pad is None else x.masked_fill(pad, 0.0)
