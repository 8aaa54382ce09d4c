"""``ACTBlock`` (registered as ``act``, alias ``universal``): a shared block over depth with per-position halting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import Attention
from attnkit.errors import InvalidInputError
from attnkit.layers import Block, TransformerBlock

from .._checks import positive_int, real
from .coordinates import coordinates

__all__ = ["ACTBlock", "ACTInfo"]


@dataclass
class ACTInfo:
    """What one forward of an :class:`ACTBlock` did.

    Attributes:
        weights: halting weights ``(T, B, L)`` of the T steps run (each position's sum to one).
        steps: N, the number of steps each position ran, ``(B, L)``.
        remainders: R, each position's remainder ``1 - sum of its halting probabilities before the last``, ``(B, L)``.
        ponder: ``N + R`` per position, ``(B, L)`` (the ponder cost before averaging).
    """

    weights: Tensor
    steps: Tensor
    remainders: Tensor

    @property
    def ponder(self) -> Tensor:
        return self.steps + self.remainders


class ACTBlock(Block):
    """Universal Transformer block with adaptive computation time (Dehghani et al. 2019; Graves 2016).

    One pre-norm block (:class:`attnkit.layers.TransformerBlock`, any registered
    attention inside) is applied repeatedly with shared weights. Before each
    step ``t`` the coordinate embedding of (position, step) is added to the
    state; a halting unit gives each position ``p_t = sigmoid(w · h_t + b)``.
    A position halts at the first step N where the running sum of its ``p``
    would exceed ``1 - epsilon`` (or at ``max_steps``); its halting weights
    are ``p_1 .. p_{N-1}`` and the remainder ``R = 1 - sum_{t<N} p_t`` at step N,
    summing to one, and its output is ``sum_t w_t · block(h_t)`` (Graves' mean
    state). Halted positions stay in the sequence: their state keeps being
    updated so that running positions can attend to them (as in the UT code),
    but their output no longer changes. The ponder cost ``mean(N + R)`` over
    real positions is recorded as the auxiliary loss ``ponder`` (default
    weight 0.01; the gradient reaches the halting unit through R).

    Shapes: ``x`` ``(B, L, dim)`` -> ``(B, L, dim)``; ``causal``,
    ``key_padding_mask``, ``mask``, ``attn_mask`` and ``positions`` reach the
    inner attention at every step. No streaming.

    Args:
        dim: model width.
        num_heads: heads of the inner attention.
        attention: a registered attention name or an :class:`attnkit.Attention`.
        max_steps: the most steps a position runs, >= 1.
        epsilon: halting threshold 1 - epsilon, epsilon in (0, 1) (paper: 0.01).
        halting_bias: initial bias b of the halting unit (UT: 1.0; large -> one step).
        coordinate_embedding: add the (position, step) sinusoids before each step.
        mlp_ratio: MLP width of the inner block (0: attention only).
        dropout: dropout inside the inner block.
        attention_options: options for :func:`attnkit.build`.
        **options: more options for :func:`attnkit.build`.

    Raises:
        InvalidInputError: ``max_steps`` below 1, ``epsilon`` outside (0, 1), ``halting_bias`` not finite,
            and the inner block's own errors.
    """

    def __init__(self, dim: int, num_heads: int, attention: str | Attention = "softmax", *, max_steps: int = 8,
                 epsilon: float = 0.01, halting_bias: float = 1.0, coordinate_embedding: bool = True,
                 mlp_ratio: float = 4.0, dropout: float = 0.0, attention_options: dict[str, Any] | None = None,
                 **options: Any) -> None:
        super().__init__()
        self.max_steps = positive_int("max_steps", max_steps)
        self.epsilon = real("epsilon", epsilon, low=0.0, high=1.0, low_open=True, high_open=True)
        bias = real("halting_bias", halting_bias)
        if not isinstance(coordinate_embedding, bool):
            raise InvalidInputError(f"coordinate_embedding: expected a bool, got {coordinate_embedding!r}")
        self.coordinate_embedding = coordinate_embedding
        self.dim = positive_int("dim", dim)
        self.inner = TransformerBlock(dim, num_heads, attention, mlp_ratio=mlp_ratio, dropout=dropout,
                                      attention_options=attention_options, **options)
        self.halting = nn.Linear(dim, 1)
        with torch.no_grad():
            self.halting.bias.fill_(bias)
        self.last_info: ACTInfo | None = None
        self.last_mean_steps: float | None = None
        self.last_mean_ponder: float | None = None

    @property
    def threshold(self) -> float:
        return 1.0 - self.epsilon

    def coordinates(self, L: int, step: int, like: Tensor) -> Tensor:
        """The (position, step) embedding added before step ``step``, ``(L, dim)`` (0 when disabled)."""
        if not self.coordinate_embedding:
            return like.new_zeros(L, self.dim)
        return coordinates(L, step, self.dim, device=like.device, dtype=like.dtype)

    def forward(self, x: Tensor, *, mask: Any = None, causal: bool = False, key_padding_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, positions: Any = None, state: Any = None,
                return_state: bool = False) -> Tensor:
        """``(B, L, dim)`` in and out; records the ``ponder`` auxiliary loss; :attr:`last_info` holds the halting.

        Raises:
            InvalidInputError: ``x`` not ``(B, L, dim)``, or ``state`` / ``return_state`` given (no streaming).
        """
        if state is not None or return_state:
            raise InvalidInputError("act: the ACT block keeps no state between calls (state / return_state "
                                    "are not supported); call it on the whole sequence")
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise InvalidInputError(f"x: expected a (B, L, dim={self.dim}) tensor, got {got}")
        kw = {"mask": mask, "causal": causal, "key_padding_mask": key_padding_mask, "attn_mask": attn_mask,
              "positions": positions}
        out, info = self._act(x, kw)
        real_pos = None if key_padding_mask is None else key_padding_mask.to(x.dtype)
        ponder = info.ponder.to(x.dtype)
        cost = ponder.mean() if real_pos is None else (ponder * real_pos).sum() / real_pos.sum().clamp_min(1)
        if x.shape[1] > 0:
            self.record_aux_loss("ponder", cost)
        self.last_info = ACTInfo(info.weights.detach(), info.steps.detach(), info.remainders.detach())
        steps = info.steps.detach()
        self.last_mean_steps = float(steps.mean() if real_pos is None
                                     else (steps * real_pos).sum() / real_pos.sum().clamp_min(1))
        self.last_mean_ponder = float(cost.detach())
        return out

    def lab_stats(self) -> dict[str, Any]:
        """For ``attnkit train``: average ACT steps N and ponder cost N + R per real position, last forward."""
        if self.last_mean_steps is None:
            return {}
        return {"act_steps": round(self.last_mean_steps, 3), "act_ponder": round(self.last_mean_ponder, 3)}

    def _act(self, x: Tensor, kw: dict[str, Any]) -> tuple[Tensor, ACTInfo]:
        B, L, _ = x.shape
        halt_sum = x.new_zeros(B, L)
        running = torch.ones(B, L, dtype=torch.bool, device=x.device)
        steps = x.new_zeros(B, L)
        rem = x.new_zeros(B, L)
        out = torch.zeros_like(x)
        weights = []
        h = x
        zero = x.new_zeros(())
        for t in range(self.max_steps):
            h = h + self.coordinates(L, t, x)
            p = torch.sigmoid(self.halting(h)).squeeze(-1)
            new = self.inner(h, **kw)
            halt_now = running & ((halt_sum + p > self.threshold) | (t == self.max_steps - 1))
            cont = running & ~halt_now
            r = torch.where(halt_now, 1.0 - halt_sum, zero)
            w = torch.where(cont, p, zero) + r
            halt_sum = halt_sum + torch.where(cont, p, zero)
            rem = rem + r
            steps = steps + running.to(x.dtype)
            out = out + w[..., None] * new
            weights.append(w)
            running = cont
            h = new
            if not bool(running.any()):
                break
        return out, ACTInfo(torch.stack(weights), steps, rem)

    def extra_repr(self) -> str:
        return f"max_steps={self.max_steps}, epsilon={self.epsilon:g}, coordinate_embedding={self.coordinate_embedding}"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["last_info"] = None
        return state
