"""The ``torch`` backend of gated causal RFA: the chunked gated form, readable, any device.

``S_t = g_t S_{t-1} + phi_k_t v_t^T`` and ``z_t = g_t z_{t-1} + phi_k_t``
(the caller folds RFA's input gate ``1 - g_t`` into ``phi_k``),
``out_t = phi_q_t^T S_t / phi_q_t . z_t``. Inside a chunk of C positions the
decays are relative cumulative log-sums ``exp(c_t - c_j)`` (all exponents
<= 0, masked before the exponential, so nothing overflows); across chunks a
loop over the L/C chunks carries the state. The denominator rides along as a
column of ones appended to ``v``; later positions are masked with
``masked_fill``, so an Inf or NaN there cannot reach an earlier output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.transforms import symbolic

from ..common import DEFAULT_CHUNK, START_GROUP, chunk_outputs, normalize, split_chunks, with_ones_column


def gated_num_den(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, S0: Tensor | None = None,
                  z0: Tensor | None = None, *, chunk: int = DEFAULT_CHUNK
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gated causal numerator ``(B, H, L, E)``, denominator ``(B, H, L)`` and the final state ``(S, z)``.

    Args:
        phi_q, phi_k: ``(B, H, L, M)``; v: ``(B, H, L, E)``.
        log_g: ``(B, H, L)`` log of the decay ``g_t`` in (0, 1] (0 = no decay).
        S0, z0: ``(B, H, M, E)``, ``(B, H, M)`` carried in (None: zeros).
        chunk: positions per chunk.
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    C, N, (q, k, w, lg) = split_chunks(chunk, phi_q, phi_k, with_ones_column(v), log_g.unsqueeze(-1),
                                       group=START_GROUP)
    lg = lg.squeeze(-1)                                     # (B, H, N, C)
    cum = torch.cumsum(lg, dim=-1)                          # log decay from chunk start to t (inclusive)
    future = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    # decay from j to t is exp(cum_t - cum_j) for j <= t; masked before exp (no overflow) and after (no NaN)
    rel = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(future, float("-inf"))
    intra = ((q @ k.transpose(-1, -2)) * rel.exp()).masked_fill(future, 0.0) @ w    # (B, H, N, C, E+1)
    to_end = (cum[..., -1:] - cum).exp()                    # decay from j to the chunk's end
    kv = (k * to_end.unsqueeze(-1)).transpose(-1, -2) @ w   # the chunk's own contribution to its end state
    from_start = cum.exp().unsqueeze(-1)                    # decay from the chunk start to t
    dynamic = symbolic(N)
    S = torch.cat([phi_q.new_zeros(B, H, M, E) if S0 is None else S0,
                   (phi_q.new_zeros(B, H, M) if z0 is None else z0).unsqueeze(-1)], dim=-1)
    if dynamic:
        # a dynamic length under torch.export (a Python loop would fix the chunk count, a multiple of the group
        # here): every chunk's start state in two levels (chunk_outputs); levels are minus the log decay since the
        # sequence start (chunk j ends at minus the decay through it, the carried state at 0)
        ends = -torch.cumsum(cum[..., -1], dim=-1)                                 # (B, H, N)
        out, S = chunk_outputs(ends.unsqueeze(-1), ends.new_zeros(B, H, 1), kv, S, q * from_start, intra,
                               group=START_GROUP)
        out = out.reshape(B, H, -1, E + 1)[:, :, :L]
        return out[..., :E], out[..., E], S[..., :E], S[..., E]
    total = cum[..., -1].exp() if N else cum.new_zeros(B, H, 0)   # (B, H, N) decay across a chunk
    outs = [q.new_zeros(B, H, 0, E + 1)]
    for n in range(N):  # over chunks, not positions
        outs.append(intra[:, :, n] + (q[:, :, n] * from_start[:, :, n]) @ S)
        S = total[:, :, n, None, None] * S + kv[:, :, n]
    out = torch.cat(outs, dim=2)[:, :, :L]
    return out[..., :E], out[..., E], S[..., :E], S[..., E]


def gated_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, S0: Tensor | None = None,
                    z0: Tensor | None = None, *, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """Normalised gated causal linear attention (the ``torch`` backend of causal ``rfa``): ``(out, S, z)``."""
    num, den, S, z = gated_num_den(phi_q, phi_k, v, log_g, S0, z0, chunk=chunk)
    return normalize(num, den), S, z
