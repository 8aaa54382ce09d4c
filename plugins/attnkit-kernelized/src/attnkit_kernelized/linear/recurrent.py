"""The step form of causal linear attention: one position at a time from a carried state (any device).

``S_t = S_{t-1} + phi_k_t v_t^T``, ``z_t = z_{t-1} + phi_k_t``,
``out_t = phi_q_t^T S_t / phi_q_t . z_t`` (0 where the denominator is 0).
``step()`` (decoding, a few positions per call) runs it; ``forward(...,
state=..., return_state=True)`` runs the chosen backend's chunked form or
kernel from the same state instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import normalize


def linear_attention_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, S: Tensor, z: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """Consume ``T`` positions: ``phi_q, phi_k (B, H, T, M)``, ``v (B, H, T, E)``, state ``S (B, H, M, E)``,
    ``z (B, H, M)``; returns ``(out (B, H, T, E), S, z)``."""
    B, H, T, _ = phi_q.shape
    outs = [v.new_zeros(B, H, 0, v.shape[-1])]
    for t in range(T):
        k_t = phi_k[:, :, t]
        S = S + k_t.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        z = z + k_t
        q_t = phi_q[:, :, t]
        num = (q_t.unsqueeze(-2) @ S).squeeze(-2)
        outs.append(normalize(num, (q_t * z).sum(-1)).unsqueeze(2))
    return torch.cat(outs, dim=2), S, z
