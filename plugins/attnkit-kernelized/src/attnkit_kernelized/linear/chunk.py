"""The ``torch`` backend of linear attention (``linear``, ``performer``, ungated ``rfa``): readable, any device.

Features in place of the head dimension: ``phi_q (B, H, L, M)``,
``phi_k (B, H, S, M)``, ``v (B, H, S, E)``.

* non-causal: two matmuls, ``phi_q (S0 + phi_k^T v)`` and ``phi_q . (z0 + sum_j phi_k_j)``.
* causal: positions in chunks of ``C``; inside a chunk a masked ``C x C``
  block, across chunks an exclusive prefix sum of the per-chunk states
  ``phi_k^T v`` (one ``cumsum``, no Python loop). Work
  O(L·C·(M + E) + L·M·E), memory O(L/C · M·E).

The denominator rides along as a column of ones appended to ``v``. Masks
inside a chunk are applied with ``masked_fill``, never by multiplying with
0, so an Inf or NaN at a later position cannot reach an earlier output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.transforms import symbolic

from ..common import DEFAULT_CHUNK, normalize, split_chunks, with_ones_column


def _state(S0: Tensor | None, z0: Tensor | None, phi_q: Tensor, E: int) -> Tensor:
    """``[S0, z0]`` as one ``(B, H, M, E+1)`` tensor (zeros for None)."""
    B, H, _, M = phi_q.shape
    S0 = phi_q.new_zeros(B, H, M, E) if S0 is None else S0
    z0 = phi_q.new_zeros(B, H, M) if z0 is None else z0
    return torch.cat([S0, z0.unsqueeze(-1)], dim=-1)


def linear_num_den(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor | None = None, z0: Tensor | None = None,
                   *, causal: bool, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Numerator ``(B, H, L, E)``, denominator ``(B, H, L)`` and the final state ``(S, z)``.

    ``num_t = phi_q_t^T (S0 + sum_{j in J(t)} phi_k_j v_j^T)``,
    ``den_t = phi_q_t . (z0 + sum_{j in J(t)} phi_k_j)``; ``J(t)`` is ``j <= t``
    (causal, L == S) or every key.
    """
    E = v.shape[-1]
    B, H, L, M = phi_q.shape
    Sp0 = _state(S0, z0, phi_q, E)
    vp = with_ones_column(v)
    if not causal:
        final = Sp0 + phi_k.transpose(-1, -2) @ vp                      # (B, H, M, E+1)
        out = phi_q @ final
        return out[..., :E], out[..., E], final[..., :E], final[..., E]
    C, N, (q, k, w) = split_chunks(chunk, phi_q, phi_k, vp)
    future = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    intra = (q @ k.transpose(-1, -2)).masked_fill(future, 0.0) @ w      # (B, H, N, C, E+1)
    kv = k.transpose(-1, -2) @ w                                          # per-chunk states (B, H, N, M, E+1)
    # inclusive prefix sum over chunks from the carried state; each chunk starts from the one before
    ends = Sp0.unsqueeze(2) + torch.cumsum(kv, dim=2)
    starts = torch.cat([Sp0.unsqueeze(2), ends], dim=2)[:, :, :N]
    out = (intra + q @ starts).reshape(B, H, N * C, E + 1)[:, :, :L]
    final = ends[:, :, -1] if symbolic(N) or N else Sp0
    return out[..., :E], out[..., E], final[..., :E], final[..., E]


def linear_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, S0: Tensor | None = None, z0: Tensor | None = None,
                     *, causal: bool, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised linear attention (the ``torch`` backend): ``(out (B, H, L, E), S (B, H, M, E), z (B, H, M))``.

    ``out = num / den``, 0 where a query sees no key (see :func:`linear_num_den`).
    """
    num, den, S, z = linear_num_den(phi_q, phi_k, v, S0, z0, causal=causal, chunk=chunk)
    return normalize(num, den), S, z
