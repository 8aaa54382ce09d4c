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


def padded(key_padding_mask: Tensor | None) -> Tensor | None:
    """``(B, 1, S, 1)`` bool, True at padded keys (from a ``(B, S)`` mask, True = real), or None."""
    return None if key_padding_mask is None else ~key_padding_mask[:, None, :, None]


def zero_padded(x: Tensor, pad: Tensor | None) -> Tensor:
    """``x (B, H, S, F)`` with the rows of padded keys set to 0 (``masked_fill``: Inf and NaN there go too)."""
    return x if pad is None else x.masked_fill(pad, 0.0)
