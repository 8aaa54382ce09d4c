"""The step form of gated causal RFA: one position at a time from a carried state (any device).

``S_t = g_t S_{t-1} + phi_k_t v_t^T``, ``z_t = g_t z_{t-1} + phi_k_t`` (the
input gate folded into ``phi_k``), ``out_t = phi_q_t^T S_t / phi_q_t . z_t``.
``step()`` runs it; ``forward(..., state=..., return_state=True)`` runs the
chosen backend from the same state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import normalize


def gated_attention_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, log_g: Tensor, S: Tensor, z: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """Consume ``T`` positions (``log_g (B, H, T)``) from the state ``S (B, H, M, E)``, ``z (B, H, M)``;
    returns ``(out (B, H, T, E), S, z)``."""
    B, H, T, _ = phi_q.shape
    outs = [v.new_zeros(B, H, 0, v.shape[-1])]
    for t in range(T):
        g = log_g[:, :, t].exp()
        k_t = phi_k[:, :, t]
        S = g[..., None, None] * S + k_t.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        z = g[..., None] * z + k_t
        q_t = phi_q[:, :, t]
        num = (q_t.unsqueeze(-2) @ S).squeeze(-2)
        outs.append(normalize(num, (q_t * z).sum(-1)).unsqueeze(2))
    return torch.cat(outs, dim=2), S, z
