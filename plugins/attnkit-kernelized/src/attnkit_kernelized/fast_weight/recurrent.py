"""The step form of the delta rule: one position at a time from a carried state (any device).

``S_t = S_{t-1} + beta_t phi_k_t (v_t - S_{t-1}^T phi_k_t)^T``, ``out_t = S_t^T phi_q_t``.
``step()`` runs it; ``forward(..., state=..., return_state=True)`` runs the
chosen backend from the same state.
"""

from __future__ import annotations

import torch
from torch import Tensor


def delta_rule_step(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """Consume ``T`` positions (``beta (B, H, T)``) from the state ``S (B, H, M, E)``; ``(out (B, H, T, E), S)``."""
    B, H, T, _ = phi_q.shape
    outs = [v.new_zeros(B, H, 0, v.shape[-1])]
    for t in range(T):
        k_t = phi_k[:, :, t]
        retrieved = (k_t.unsqueeze(-2) @ S).squeeze(-2)                      # S^T k_t
        S = S + beta[:, :, t, None, None] * k_t.unsqueeze(-1) * (v[:, :, t] - retrieved).unsqueeze(-2)
        outs.append(phi_q[:, :, t].unsqueeze(-2) @ S)
    return torch.cat(outs, dim=2), S
