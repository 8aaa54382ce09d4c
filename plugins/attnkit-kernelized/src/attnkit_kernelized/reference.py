"""Slow, obviously-correct versions, used only by the tests.

Each function is a Python loop over positions that follows the paper's
recurrence literally. Shapes: ``phi_q (B, H, L, M)``, ``phi_k (B, H, S, M)``,
``v (B, H, S, E)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def linear_reference(phi_q: Tensor, phi_k: Tensor, v: Tensor, *, causal: bool) -> tuple[Tensor, Tensor]:
    """Numerator and denominator of linear attention, one position at a time.

    Non-causal: ``num_i = sum_j (phi_q_i . phi_k_j) v_j`` written as a double loop.
    Causal: the recurrence ``S_t = S_{t-1} + phi_k_t v_t^T``, ``z_t = z_{t-1} + phi_k_t``,
    ``num_t = S_t^T phi_q_t``, ``den_t = z_t . phi_q_t``.
    """
    B, H, L, M = phi_q.shape
    S_len, E = v.shape[2], v.shape[3]
    num = phi_q.new_zeros(B, H, L, E)
    den = phi_q.new_zeros(B, H, L)
    if not causal:
        for i in range(L):
            for j in range(S_len):
                a = (phi_q[:, :, i] * phi_k[:, :, j]).sum(-1)
                num[:, :, i] += a[..., None] * v[:, :, j]
                den[:, :, i] += a
        return num, den
    S = phi_q.new_zeros(B, H, M, E)
    z = phi_q.new_zeros(B, H, M)
    for t in range(L):
        S = S + phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        z = z + phi_k[:, :, t]
        num[:, :, t] = (phi_q[:, :, t, :, None] * S).sum(-2)
        den[:, :, t] = (phi_q[:, :, t] * z).sum(-1)
    return num, den


def gated_reference(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Gated RFA (Peng et al. 2021, eq. 7): ``S_t = g_t S_{t-1} + (1 - g_t) phi_k_t v_t^T``,
    ``z_t = g_t z_{t-1} + (1 - g_t) phi_k_t``; returns ``(S_t^T phi_q_t, z_t . phi_q_t)``.

    Args:
        g: ``(B, H, L)`` gates in [0, 1].
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    S = phi_q.new_zeros(B, H, M, E)
    z = phi_q.new_zeros(B, H, M)
    num = phi_q.new_zeros(B, H, L, E)
    den = phi_q.new_zeros(B, H, L)
    for t in range(L):
        gt = g[:, :, t, None]
        S = gt[..., None] * S + (1 - gt)[..., None] * phi_k[:, :, t, :, None] * v[:, :, t, None, :]
        z = gt * z + (1 - gt) * phi_k[:, :, t]
        num[:, :, t] = (phi_q[:, :, t, :, None] * S).sum(-2)
        den[:, :, t] = (phi_q[:, :, t] * z).sum(-1)
    return num, den


def delta_reference(phi_q: Tensor, phi_k: Tensor, v: Tensor, beta: Tensor) -> Tensor:
    """Delta rule (Schlag et al. 2021, eq. 23-25), fast weights ``W`` of shape (E, M):

    ``v_bar = W_{t-1} phi_k_t``; ``W_t = W_{t-1} + beta_t (v_t - v_bar) phi_k_t^T``;
    ``y_t = W_t phi_q_t``.

    Args:
        beta: ``(B, H, L)`` write strengths.
    """
    B, H, L, M = phi_q.shape
    E = v.shape[-1]
    W = phi_q.new_zeros(B, H, E, M)
    out = phi_q.new_zeros(B, H, L, E)
    for t in range(L):
        k_t = phi_k[:, :, t]
        v_bar = (W * k_t[:, :, None, :]).sum(-1)
        W = W + beta[:, :, t, None, None] * (v[:, :, t] - v_bar)[..., None] * k_t[:, :, None, :]
        out[:, :, t] = (W * phi_q[:, :, t, None, :]).sum(-1)
    return out


def normalize(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with rows whose denominator is exactly 0 (no visible key) set to 0."""
    out = num / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return torch.where((den == 0)[..., None], torch.zeros_like(out), out)


def softmax_reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None
                      ) -> Tensor:
    """Exact softmax attention in float64 (for error measurements)."""
    from attnkit.reference import reference_attention

    return reference_attention(q, k, v, causal=causal, scale=scale)
