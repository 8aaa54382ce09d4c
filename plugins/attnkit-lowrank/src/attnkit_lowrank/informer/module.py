"""``informer`` (alias ``probsparse``): :class:`InformerAttention` (ProbSparse, Zhou et al. 2021), the torch path.

Each query's sparsity measure ``M(q_i) = max_j q_i·k_j - sum_j q_i·k_j / S``
over ``U = factor·ceil(ln S)`` sampled keys (the paper's estimate, sampled
with replacement, one draw per query shared by batch and heads, from a
generator seeded with ``seed``: reproducible and independent of the global
RNG). The ``u = factor·ceil(ln L)`` queries with the largest M ("active")
attend with full softmax attention; the others ("lazy") output the mean of
V. With ``u >= L`` every query is active: exact softmax attention.
Cost O(L·U·D + u·S·D) instead of O(L·S·D).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import attnkit

from ..common import check_int
from ..plugin import INFORMER


def counts(factor: int, L: int, S: int) -> tuple[int, int]:
    """``(U, u)``: sampled keys per query and active queries (the paper's ``c·ceil(ln n)``, capped)."""
    U = min(factor * math.ceil(math.log(S)) if S > 1 else 1, S)
    u = min(factor * math.ceil(math.log(L)) if L > 1 else 1, L)
    return U, u


def sample_indices(seed: int, L: int, S: int, U: int, device: torch.device) -> Tensor:
    """``(L, U)`` key indices sampled with replacement, from ``torch.Generator().manual_seed(seed)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(S, (L, U), generator=g).to(device)


class InformerAttention(attnkit.Attention):
    """Informer's ProbSparse self-attention: the top-u queries attend, the rest output mean(V).

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` ->
    ``(B, H, L, E)``. Non-causal (also cross-attention). Queries interact (the
    top-u choice ranks them against each other).

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of ``q·k`` in the softmax of the active queries; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        factor: sampling factor c (the paper's 5): ``U = c·ceil(ln S)`` sampled
            keys, ``u = c·ceil(ln L)`` active queries.
        seed: seed of the key sample.
        chunk_size: queries per chunk of the sampled-score computation (memory
            O(chunk_size·U·D)).

    Raises:
        InvalidInputError: an option of the wrong type or out of range.
        UnsupportedFeatureError: causal, key padding, ``attn_mask``.
    """

    option_constraints = {"factor": {"minimum": 1}, "seed": {"minimum": 0}, "chunk_size": {"minimum": 1}}
    capabilities = INFORMER.capabilities
    refusal_reasons = {
        "causal": ("the paper's causal form picks the top-u queries over the whole sequence, so a later query "
                   "changes which earlier queries are active: not causal; not offered"),
        "key_padding_mask": "the sampled keys and the lazy mean(V) would count padded keys",
        "attn_mask": "a per-pair mask is not offered by ProbSparse attention",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", factor: int = 5, seed: int = 0, chunk_size: int = 1024) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.factor = check_int("factor", factor)
        self.seed = check_int("seed", seed, minimum=0)
        self.chunk_size = check_int("chunk_size", chunk_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, factor={self.factor}, seed={self.seed}"

    def sparsity(self, q: Tensor, k: Tensor) -> Tensor:
        """``M(q_i)`` ``(B, H, L)`` over the sampled keys (no gradient: it only selects)."""
        B, H, L, D = q.shape
        S = k.shape[2]
        U, _ = counts(self.factor, L, S)
        idx = sample_indices(self.seed, L, S, U, q.device)
        out = []
        with torch.no_grad():
            for i in range(0, L, self.chunk_size):
                ks = k[:, :, idx[i:i + self.chunk_size]]                     # (B, H, c, U, D)
                s = (ks @ q[:, :, i:i + self.chunk_size, :, None]).squeeze(-1)  # (B, H, c, U)
                out.append(s.amax(-1) - s.sum(-1) / S)
        return torch.cat(out, -1)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        B, H, L, D = q.shape
        S, E = k.shape[2], v.shape[-1]
        _, u = counts(self.factor, L, S)
        out = v.mean(2, keepdim=True).expand(B, H, L, E)
        if u >= L:
            return torch.softmax(q @ (ctx.scale * k).transpose(-1, -2), -1) @ v
        top = self.sparsity(q, k).topk(u, -1).indices                        # (B, H, u)
        q_top = q.gather(2, top[..., None].expand(B, H, u, D))
        active = torch.softmax(q_top @ (ctx.scale * k).transpose(-1, -2), -1) @ v
        return out.scatter(2, top[..., None].expand(B, H, u, E), active)
