"""Shared pieces: option checks, the two iterative pseudo-inverses and segment landmarks.

The pseudo-inverses are the mechanisms' own (each paper iterates a fixed
number of times), so the module and its plain reference both call these: the
reference checks everything around them, and ``tests/test_pinv.py`` checks the
iterations themselves against :func:`torch.linalg.pinv`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit import InvalidInputError


def check_int(name: str, value: Any, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (or None when allowed); else InvalidInputError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + (" or None" if allow_none else "")
        raise InvalidInputError(f"{name}: expected {expected}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool; else InvalidInputError naming ``name``."""
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name}: expected a bool, got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; else InvalidInputError naming ``name`` and the choices."""
    if value not in choices:
        raise InvalidInputError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def _eye_like(a: Tensor) -> Tensor:
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)


def nystrom_pinv(a: Tensor, iterations: int) -> Tensor:
    """Nystromformer's iterative pseudo-inverse of ``a`` ``(..., m, m)`` (Razavi et al. 2014).

    ``Z_0 = a^T / (|a|_1 |a|_inf)`` per matrix (the paper's code takes the two
    norms over the whole batch; per matrix keeps batch elements independent),
    then ``Z <- 1/4 Z (13 I - a Z (15 I - a Z (7 I - a Z)))`` ``iterations`` times.
    Differentiable (matrix products only).
    """
    absa = a.abs()
    norm1 = absa.sum(-2).amax(-1, keepdim=True).unsqueeze(-1)     # max column sum
    norminf = absa.sum(-1).amax(-1, keepdim=True).unsqueeze(-1)   # max row sum
    z = a.transpose(-1, -2) / (norm1 * norminf)
    eye = _eye_like(a)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def newton_pinv(a: Tensor, iterations: int) -> Tensor:
    """SOFT's Newton-Raphson Moore-Penrose iteration for ``a`` ``(..., m, m)`` (Algorithm 2 of the paper).

    ``V_0 = a^T / (|a|_1 |a|_inf)`` (below ``2 / sigma_max^2``, so the iteration
    converges to the pseudo-inverse), then ``V <- 2 V - V a V`` ``iterations`` times.
    """
    absa = a.abs()
    norm1 = absa.sum(-2).amax(-1, keepdim=True).unsqueeze(-1)
    norminf = absa.sum(-1).amax(-1, keepdim=True).unsqueeze(-1)
    z = a.transpose(-1, -2) / (norm1 * norminf)
    for _ in range(iterations):
        z = 2 * z - z @ (a @ z)
    return z


def segment_weights(keep: Tensor | None, batch: int, n: int, m: int, dtype: torch.dtype,
                    device: torch.device) -> Tensor:
    """Averaging weights ``(B, 1, m, n)`` of ``m`` segment-mean landmarks over the kept tokens.

    Row b with ``c`` kept tokens (``keep`` bool ``(B, n)``, None = all kept)
    numbers them ``r = 0..c-1`` in order; landmark ``j`` is the mean of the
    kept tokens with ``floor(j·c/m) <= r < floor((j+1)·c/m)``, or of the one
    token ``r = floor(j·c/m)`` when that range is empty (``c < m``: landmarks
    repeat). A row with no kept token has all-zero weights. Padded tokens get
    weight 0, so they never enter a landmark.
    """
    if keep is None:
        keep = torch.ones(batch, n, dtype=torch.bool, device=device)
    c = keep.sum(-1, keepdim=True)                                     # (B, 1)
    rank = keep.long().cumsum(-1) - 1                                  # (B, n)
    j = torch.arange(m, device=device)
    lo = torch.div(j[None, :] * c, m, rounding_mode="floor")           # (B, m)
    hi = torch.maximum(torch.div((j[None, :] + 1) * c, m, rounding_mode="floor"), lo + 1)
    inside = keep[:, None, :] & (rank[:, None, :] >= lo[:, :, None]) & (rank[:, None, :] < hi[:, :, None])
    w = inside.to(dtype) / (hi - lo).to(dtype)[:, :, None]
    return w[:, None]


#: elements of one query chunk's (chunk, m) score block per head: small enough to stay in cache
CHUNK_ELEMENTS = 1 << 16


def chunk_rows(L: int, m: int) -> int:
    """Queries per chunk for ``m`` columns: about CHUNK_ELEMENTS scores per head, between 64 and L."""
    return max(64, min(L, CHUNK_ELEMENTS // max(m, 1)))


def softmax_attend(q: Tensor, kt: Tensor, v: Tensor) -> Tensor:
    """``softmax(q @ kt) @ v`` for ``q`` ``(B, H, L, D)``, ``kt`` ``(..., D, m)``, ``v`` ``(..., m, E)``.

    Query chunks of ``chunk_rows(L, m)`` rows: each ``(chunk, m)`` score block is
    computed, normalised and used while it is still in cache (the whole
    ``(L, m)`` block written and read three times ran at half the speed: 16K
    queries x 256 columns x 8 heads, one thread, 338 -> 164 ms). Same values,
    same autograd (``split`` gives each chunk's gradient back as one ``cat``).
    """
    L, m = q.shape[2], kt.shape[-1]
    c = chunk_rows(L, m)
    if c >= L:
        return torch.softmax(q @ kt, -1) @ v
    # split, not slicing: a slice's backward writes a whole (B, H, L, D) zero tensor per chunk
    return torch.cat([torch.softmax(qc @ kt, -1) @ v for qc in q.split(c, dim=2)], 2)
