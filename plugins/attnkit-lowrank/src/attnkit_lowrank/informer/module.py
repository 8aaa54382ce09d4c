"""``informer`` (alias ``probsparse``): :class:`InformerAttention` (ProbSparse, Zhou et al. 2021), the torch path.

Each query's sparsity measure ``M(q_i) = max_j q_i·k_j - sum_j q_i·k_j / S``
over ``U = factor·ceil(ln S)`` sampled keys (the paper's estimate, sampled
with replacement, one draw per query shared by batch and heads, from a
generator seeded with ``seed``: reproducible and independent of the global
RNG). The ``u = factor·ceil(ln L)`` queries with the largest M ("active")
attend with full softmax attention; the others ("lazy") output the mean of
V. With ``u >= L`` every query is active: exact softmax attention.
Cost O(L·U·D + u·S·D) instead of O(L·S·D).

Causal form (L == S; the paper's masked ProbSparse decoder attention, made
causal in its query selection too). The paper ranks all L queries at once, so a
later query decides whether an earlier one is active: that leaks the future.
Here everything query i uses comes from positions <= i:

* its U sampled keys are drawn from the prefix ``0..i`` (``floor(r·(i+1))``,
  ``r`` uniform from the seeded generator), and its measure is
  ``max_t s_t - sum_t s_t / (i+1)`` (the non-causal ``sum / S`` with S the
  keys it may see);
* it is active iff fewer than u of the earlier queries ``j < i`` have
  ``M(q_j) >= M(q_i)`` (an online top-u: ties go to the earlier query, the
  first u queries are always active); about ``u·(1 + ln(L/u))`` queries are
  active on shuffled measures, at most L;
* an active query attends with causally masked softmax over keys ``0..i``; a
  lazy one outputs the cumulative mean ``mean(V[0..i])``.

With ``u >= L`` every query is active: exact causal softmax attention.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import attnkit
from attnkit.caching import outside_trace

from ..common import Float32Inside, check_int
from ..plugin import INFORMER


def counts(factor: int, L: int, S: int) -> tuple[int, int]:
    """``(U, u)``: sampled keys per query and active queries (the paper's ``c·ceil(ln n)``, capped)."""
    U = min(factor * math.ceil(math.log(S)) if S > 1 else 1, S)
    u = min(factor * math.ceil(math.log(L)) if L > 1 else 1, L)
    return U, u


def sample_indices(seed: int, L: int, S: int, U: int, device: torch.device) -> Tensor:
    """``(L, U)`` key indices sampled with replacement, from ``torch.Generator().manual_seed(seed)``."""
    with outside_trace():   # seeded draws of the shape: under torch.export a constant, not a generator op
        g = torch.Generator().manual_seed(seed)
        return torch.randint(S, (L, U), generator=g).to(device)


def causal_sample_indices(seed: int, L: int, U: int, device: torch.device) -> Tensor:
    """``(L, U)`` key indices, row i drawn uniformly from ``0..i`` (``floor(r·(i+1))``, r seeded, float64)."""
    with outside_trace():   # seeded draws of the shape: under torch.export a constant, not a generator op
        g = torch.Generator().manual_seed(seed)
        r = torch.rand((L, U), generator=g, dtype=torch.float64)
        n = torch.arange(1, L + 1, dtype=torch.float64)[:, None]
        return torch.minimum((r * n).floor().long(), (n.long() - 1)).to(device)


def online_top(m: Tensor, u: int, chunk: int) -> Tensor:
    """bool ``(B, H, L)``: i is active iff fewer than ``u`` of ``m[..., :i]`` are ``>= m[..., i]``.

    Chunks of ``chunk`` queries against the running top-u of the earlier ones
    (exact: when fewer than u earlier values are >= m_i they are all in the
    top-u), plus a strict lower triangle inside the chunk: O(L·(u + chunk)).
    """
    B, H, L = m.shape
    top = m.new_full((B, H, 0), float("-inf"))
    out = []
    for i in range(0, L, chunk):
        mc = m[..., i:i + chunk]
        c = mc.shape[-1]
        before = (top[..., None, :] >= mc[..., :, None]).sum(-1)
        tri = torch.ones(c, c, dtype=torch.bool, device=m.device).tril(-1)      # j < i inside the chunk
        inside = ((mc[..., None, :] >= mc[..., :, None]) & tri).sum(-1)
        out.append(before + inside < u)
        both = torch.cat([top, mc], -1)
        top = both.topk(min(u, both.shape[-1]), -1).values
    return torch.cat(out, -1)


class InformerAttention(Float32Inside, attnkit.Attention):
    """Informer's ProbSparse self-attention: the top-u queries attend, the rest output mean(V).

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` ->
    ``(B, H, L, E)``. Non-causal (also cross-attention) and causal (L == S,
    the module docstring's form: selection, attention and lazy mean use only
    the past). Queries interact (the top-u choice ranks them against each other).

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
        UnsupportedFeatureError: key padding, ``attn_mask``, causal with L != S.
    """

    option_constraints = {"factor": {"minimum": 1}, "seed": {"minimum": 0}, "chunk_size": {"minimum": 1}}
    capabilities = INFORMER.capabilities
    refusal_reasons = {
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

    def causal_sparsity(self, q: Tensor, k: Tensor) -> Tensor:
        """Causal ``M(q_i)`` ``(B, H, L)``: U keys sampled from ``0..i``, ``max - sum / (i+1)`` (no gradient)."""
        B, H, L, D = q.shape
        U, _ = counts(self.factor, L, L)
        idx = causal_sample_indices(self.seed, L, U, q.device)
        n = torch.arange(1, L + 1, dtype=q.dtype, device=q.device)
        out = []
        with torch.no_grad():
            for i in range(0, L, self.chunk_size):
                ks = k[:, :, idx[i:i + self.chunk_size]]                     # (B, H, c, U, D)
                s = (ks @ q[:, :, i:i + self.chunk_size, :, None]).squeeze(-1)  # (B, H, c, U)
                out.append(s.amax(-1) - s.sum(-1) / n[i:i + self.chunk_size])
        return torch.cat(out, -1)

    def _causal(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        B, H, L, D = q.shape
        E = v.shape[-1]
        _, u = counts(self.factor, L, L)
        pos = torch.arange(L, device=q.device)
        lazy = v.cumsum(2) / (pos + 1).to(v.dtype)[:, None]                   # mean(V[0..i])
        active = online_top(self.causal_sparsity(q, k), u, self.chunk_size)  # (B, H, L)
        if torch.compiler.is_exporting():
            # a size from the data: an unbacked size of the exported program, between 1 and L
            n = active.sum(-1).max().item()
            torch._check(n >= 1)
            torch._check(n <= L)
        else:
            n = int(active.sum(-1).max())
        order = torch.sort((~active).long(), dim=-1, stable=True).indices[..., :n]   # active first, in order
        valid = active.gather(-1, order)[..., None]                            # (B, H, n, 1)
        q_sel = q.gather(2, order[..., None].expand(B, H, n, D))
        s = q_sel @ (ctx.scale * k).transpose(-1, -2)                          # (B, H, n, L)
        s = s.masked_fill(pos[None, None, None, :] > order[..., None], float("-inf"))  # key 0 always seen
        att = torch.softmax(s, -1) @ v
        idx = order[..., None].expand(B, H, n, E)
        return lazy.scatter(2, idx, torch.where(valid, att, lazy.gather(2, idx)))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        if ctx.causal:
            return self._causal(q, k, v, ctx)
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
