"""Readable, vectorised torch forms of the kernelized attentions.

These are the ``torch`` backend (any device) and the definition the numba and
triton kernels are tested against. Shapes follow the contract with features
in place of the head dimension: ``phi_q (B, H, L, M)``, ``phi_k (B, H, S, M)``,
``v (B, H, S, E)``.

* :func:`noncausal_linear`: two matmuls, ``phi_q (phi_k^T v)`` and
  ``phi_q (phi_k^T 1)``.
* :func:`causal_linear`: the chunked causal form. Positions are grouped in
  chunks of ``C``; inside a chunk a masked ``C x C`` block, across chunks an
  exclusive prefix sum of the per-chunk states ``phi_k^T v`` (one ``cumsum``,
  no Python loop). Work O(L·C·(M + E) + L·M·E), memory O(L/C · M·E).
* :func:`causal_gated`: the same with a per-position decay ``g_t``
  (gated RFA): ``S_t = g_t S_{t-1} + phi_k_t v_t^T``. Inside a chunk the
  decays are relative cumulative log-sums (all exponents <= 0); across chunks
  a loop over chunks (L/C steps, not L).
* :func:`causal_delta`: the delta rule
  ``S_t = S_{t-1} + beta_t phi_k_t (v_t - S_{t-1}^T phi_k_t)^T`` in chunks
  (the WY / UT-transform form of Yang et al. 2024, arXiv 2406.06484):
  per chunk one triangular solve, then a loop over chunks.

Every causal form takes an optional initial state and returns the final one,
so ``step`` (streaming) and ``forward(causal=True)`` share one code path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK = 64


def _pad_to(x: Tensor, n: int) -> Tensor:
    """Zero-pad dim 2 of ``x`` to length ``n``."""
    extra = n - x.shape[2]
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra))


def _check_chunk(chunk: int) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1, got {chunk!r}")
    return chunk


def _split_chunks(chunk: int, *xs: Tensor) -> tuple[int, int, list[Tensor]]:
    """Zero-pad the length (dim 2) to a multiple of ``C = min(chunk, L)`` and split it.

    Each ``(B, H, L, F)`` tensor becomes ``(B, H, N, C, F)``; returns ``(C, N, tensors)``.
    """
    _check_chunk(chunk)
    L = xs[0].shape[2]
    C = min(chunk, max(L, 1))
    N = -(-L // C)
    return C, N, [_pad_to(x, N * C).reshape(*x.shape[:2], N, C, x.shape[-1]) for x in xs]


def with_ones_column(v: Tensor) -> Tensor:
    """``v`` with a column of ones appended: the denominator rides along with the numerator."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def noncausal_linear(phi_q: Tensor, phi_k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Non-causal numerator and denominator.

    Args:
        phi_q: ``(B, H, L, M)``; phi_k: ``(B, H, S, M)``; v: ``(B, H, S, E)``.

    Returns:
        ``num (B, H, L, E) = phi_q (phi_k^T v)`` and ``den (B, H, L) = phi_q . sum_j phi_k_j``.
    """
    kv = phi_k.transpose(-1, -2) @ v                      # (B, H, M, E)
    num = phi_q @ kv
    den = (phi_q * phi_k.sum(dim=2, keepdim=True)).sum(-1)
    return num, den


def causal_linear(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, chunk: int = DEFAULT_CHUNK,
                  state: tuple[Tensor, Tensor] | None = None
                  ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Causal numerator, denominator and final state, in chunks.

    ``num_t = phi_q_t^T (S_0 + sum_{j<=t} phi_k_j v_j^T)`` and
    ``den_t = phi_q_t . (z_0 + sum_{j<=t} phi_k_j)``.

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``.
        chunk: positions per chunk (any length works; the tail is zero-padded).
        state: ``(S_0 (B, H, M, E), z_0 (B, H, M))`` carried in from earlier
            positions, or None for zeros.

    Returns:
        ``(num (B, H, L, E), den (B, H, L), (S_L, z_L))``.
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    C, N, (q, k, w) = _split_chunks(chunk, phi_q, phi_k, with_ones_column(v))
    keep = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    intra = ((q @ k.transpose(-1, -2)) * keep) @ w         # (B, H, N, C, E+1)
    kv = k.transpose(-1, -2) @ w                            # per-chunk states (B, H, N, M, E+1)
    # exclusive prefix sum over chunks: the state each chunk starts from
    before = torch.cat([torch.zeros_like(kv[:, :, :1]), torch.cumsum(kv[:, :, :-1], dim=2)], dim=2)
    if state is not None:
        S0, z0 = state
        before = before + torch.cat([S0, z0.unsqueeze(-1)], dim=-1).unsqueeze(2)
    out = (intra + q @ before).reshape(B, H, N * C, E + 1)[:, :, :L]
    final = before[:, :, -1] + kv[:, :, -1]
    return out[..., :E], out[..., E], (final[..., :E], final[..., E])


def causal_gated(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, *, chunk: int = DEFAULT_CHUNK,
                 state: tuple[Tensor, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """Gated causal numerator/denominator: ``S_t = g_t S_{t-1} + phi_k_t v_t^T`` (and ``z_t`` alike).

    ``num_t = phi_q_t^T S_t``, ``den_t = phi_q_t . z_t``. The caller folds any
    input gate (RFA's ``1 - g_t``) into ``phi_k``.

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``.
        log_g: ``(B, H, L)`` log of the decay ``g_t`` in (0, 1] (0 = no decay).
        chunk: positions per chunk.
        state: ``(S_0 (B, H, M, E), z_0 (B, H, M))`` or None.

    Returns:
        ``(num, den, (S_L, z_L))``.
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    C, N, (q, k, w, lg) = _split_chunks(chunk, phi_q, phi_k, with_ones_column(v), log_g.unsqueeze(-1))
    lg = lg.squeeze(-1)                                     # (B, H, N, C)
    cum = torch.cumsum(lg, dim=-1)                          # log decay from chunk start to t (inclusive)
    keep = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # decay from j to t is exp(cum_t - cum_j) for j <= t; mask before exp (no overflow)
    rel = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~keep, float("-inf"))
    intra = ((q @ k.transpose(-1, -2)) * rel.exp()) @ w    # (B, H, N, C, E+1)
    to_end = (cum[..., -1:] - cum).exp()                    # decay from j to the chunk's end
    kv = (k * to_end.unsqueeze(-1)).transpose(-1, -2) @ w   # chunk's own contribution to its end state
    from_start = cum.exp().unsqueeze(-1)                    # decay from the chunk start to t
    total = cum[..., -1].exp()                              # (B, H, N) decay across a whole chunk
    S = (torch.cat([state[0], state[1].unsqueeze(-1)], dim=-1) if state is not None
         else q.new_zeros(B, H, M, E + 1))
    outs = []
    for n in range(N):  # over chunks, not positions
        outs.append(intra[:, :, n] + (q[:, :, n] * from_start[:, :, n]) @ S)
        S = total[:, :, n, None, None] * S + kv[:, :, n]
    out = torch.stack(outs, dim=2).reshape(B, H, N * C, E + 1)[:, :, :L]
    return out[..., :E], out[..., E], (S[..., :E], S[..., E])


def causal_delta(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, *, chunk: int = DEFAULT_CHUNK,
                 state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Delta-rule fast weights, ``out_t = S_t^T phi_q_t`` with
    ``S_t = S_{t-1} + beta_t phi_k_t (v_t - S_{t-1}^T phi_k_t)^T``.

    Chunked with the UT transform: inside a chunk the new-value corrections
    ``u`` solve ``(I + tril(diag(beta) K K^T, -1)) u = diag(beta) (V - K S_0)``,
    then ``out = Q S_0 + tril(Q K^T) u`` and ``S = S_0 + K^T u``.

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``.
        beta: ``(B, H, L)`` write strengths (0 = no write).
        chunk: positions per chunk.
        state: ``S_0 (B, H, M, E)`` or None.

    Returns:
        ``(out (B, H, L, E), S_L)``.
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    C, N, (q, k, w, b) = _split_chunks(chunk, phi_q, phi_k, v, beta.unsqueeze(-1))
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A = eye + (b * (k @ k.transpose(-1, -2))) * strict       # unit lower triangular
    # T = A^{-1} diag(beta): W = T K and U = T V for every chunk at once
    WU = torch.linalg.solve_triangular(A, b * torch.cat([k, w], dim=-1), upper=False, unitriangular=True)
    Wk, U = WU[..., :M], WU[..., M:]
    qk = (q @ k.transpose(-1, -2)) * torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    S = state if state is not None else q.new_zeros(B, H, M, E)
    outs = []
    for n in range(N):  # over chunks, not positions
        u = U[:, :, n] - Wk[:, :, n] @ S                      # corrected values of this chunk
        outs.append(q[:, :, n] @ S + qk[:, :, n] @ u)
        S = S + k[:, :, n].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=2).reshape(B, H, N * C, E)[:, :, :L]
    return out, S
