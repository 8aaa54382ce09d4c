"""The ``torch`` backend of the delta rule (``fast-weight``): the chunked UT-transform form, any device.

``S_t = S_{t-1} + beta_t phi_k_t (v_t - S_{t-1}^T phi_k_t)^T``, ``out_t = S_t^T phi_q_t``,
in chunks with the WY / UT transform (Yang et al. 2024, arXiv 2406.06484):
inside a chunk the corrected values ``u`` solve
``(I + tril(diag(beta) K K^T, -1)) u = diag(beta) (V - K S_0)`` (one
unit-lower-triangular solve for every chunk at once), then
``out = Q S_0 + tril(Q K^T) u`` and ``S = S_0 + K^T u`` in a loop over chunks
(L/C steps, not L). Masks inside a chunk use ``masked_fill``, so an Inf or
NaN at a later position cannot reach an earlier output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import DEFAULT_CHUNK, split_chunks


def delta_rule(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S0: Tensor | None = None, *,
               chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """The delta rule, ``(out (B, H, L, E), S_L (B, H, M, E))``.

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``.
        beta: ``(B, H, L)`` write strengths (0 = no write).
        S0: ``(B, H, M, E)`` carried in (None: zeros).
        chunk: positions per chunk.
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    C, N, (q, k, w, b) = split_chunks(chunk, phi_q, phi_k, v, beta.unsqueeze(-1))
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu()
    future = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A = eye + (b * (k @ k.transpose(-1, -2))).masked_fill(upper, 0.0)   # unit lower triangular
    # T = A^{-1} diag(beta): W = T K and U = T V for every chunk at once
    WU = torch.linalg.solve_triangular(A, b * torch.cat([k, w], dim=-1), upper=False, unitriangular=True)
    Wk, U = WU[..., :M], WU[..., M:]
    qk = (q @ k.transpose(-1, -2)).masked_fill(future, 0.0)
    S = phi_q.new_zeros(B, H, M, E) if S0 is None else S0
    outs = [q.new_zeros(B, H, 0, E)]
    for n in range(N):  # over chunks, not positions
        u = U[:, :, n] - Wk[:, :, n] @ S                      # corrected values of this chunk
        outs.append(q[:, :, n] @ S + qk[:, :, n] @ u)
        S = S + k[:, :, n].transpose(-1, -2) @ u
    return torch.cat(outs, dim=2)[:, :, :L], S
