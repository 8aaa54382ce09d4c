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
    # unbind, not phi_k[:, :, t]: the backward of T unbinds stacks T gradients once; T indexings would each
    # fill a full-size zero tensor (quadratic in T)
    for q_t, k_t, v_t, b_t in zip(phi_q.unbind(2), phi_k.unbind(2), v.unbind(2), beta.unbind(2)):
        retrieved = (k_t.unsqueeze(-2) @ S).squeeze(-2)                      # S^T k_t
        S = S + b_t[:, :, None, None] * k_t.unsqueeze(-1) * (v_t - retrieved).unsqueeze(-2)
        outs.append(q_t.unsqueeze(-2) @ S)
    return torch.cat(outs, dim=2), S
