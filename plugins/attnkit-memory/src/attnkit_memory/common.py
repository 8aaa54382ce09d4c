"""Pieces shared by the memory attentions: sinusoidal relative encodings, the relative shift, a safe softmax.

Notation: a call attends from ``L`` queries to ``T = M + S`` keys, the ``M``
memory keys (older) followed by the ``S`` keys of the call. Queries are
bottom-right aligned: query ``i`` sits at index ``T - L + i`` of the key
sequence, and the relative distance to key ``j`` is ``d = T - L + i - j``
(``d >= 0`` for the keys it may see).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.errors import InvalidInputError
from attnkit.half import HALF_DTYPES, Float32Inside  # re-exported: the core's mixin, used by the modules

__all__ = ["sinusoid", "rel_shift", "masked_softmax", "causal_keep", "check_int_option", "Float32Inside",
           "HALF_DTYPES"]


def check_int_option(name: str, value: object, lo: int, allow_none: bool = False) -> None:
    """Raise :class:`InvalidInputError` unless ``value`` is an int >= ``lo`` (or None when allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        extra = " or None" if allow_none else ""
        raise InvalidInputError(f"{name}: expected an int >= {lo}{extra}, got {value!r}")


def sinusoid(distances: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """Sinusoidal encodings of (float) ``distances`` ``(N,)`` -> ``(N, dim)``, ``[sin | cos]`` halves.

    ``inv_freq_k = 10000^(-2k/dim)`` as in Vaswani et al. and Transformer-XL; computed in float64
    and cast, so float32 and float64 modules see the same encodings up to rounding.
    """
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64, device=distances.device) / dim))
    ang = distances.to(torch.float64)[:, None] * inv[None]
    return torch.cat([ang.sin(), ang.cos()], dim=-1).to(dtype)


def rel_shift(raw: Tensor) -> Tensor:
    """The relative shift: ``out[..., i, j] = raw[..., i, j + L - 1 - i]`` as a strided view, no copy.

    ``raw`` ``(B, H, L, T)`` holds, in column ``r``, the score of query ``i``
    against the relative encoding of distance ``T - 1 - r``. Key ``j`` is at
    distance ``d = T - L + i - j`` from query ``i``, i.e. column
    ``T - 1 - d = j + L - 1 - i``. Walking a row of the result steps one
    element in memory; the next row starts ``T - 1`` elements further, so the
    whole result is a view of ``raw`` with row stride ``T - 1`` starting at
    element ``L - 1``: no ``(L, T + 1)`` padded copy and no ``(T, T)`` matrix.
    Entries with ``d < 0`` (future keys) read a neighbouring row's values and
    must be masked by the caller (their gradient is then zero).
    """
    B, H, L, T = raw.shape
    # a view starting L - 1 elements in (as_strided keeps a view's own offset: no storage_offset() call,
    # which torch.compile cannot trace), then rows of stride T - 1
    start = raw.contiguous().reshape(-1)[L - 1:]
    return start.as_strided((B, H, L, T), (H * L * T, L * T, T - 1, 1))


def causal_keep(L: int, T: int, device: torch.device) -> Tensor:
    """bool ``(L, T)``: query ``i`` (at key index ``T - L + i``) may see key ``j <= T - L + i``."""
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return j <= (T - L) + i


def masked_softmax(scores: Tensor, keep: Tensor) -> Tensor:
    """Softmax over the last dim where ``keep``; 0 elsewhere and for rows that keep nothing (never NaN)."""
    scores = scores.masked_fill(~keep, float("-inf"))
    any_kept = keep.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~any_kept, 0.0)
    p = torch.softmax(scores, dim=-1)
    return p.masked_fill(~keep, 0.0)
