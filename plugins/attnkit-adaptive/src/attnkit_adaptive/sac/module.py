"""``SparseAdaptiveAttention`` (registered as ``sparse-adaptive``): a learned edge predictor picks each query's keys."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import Attention
from attnkit.context import CallContext
from attnkit.transforms import symbolic

from .._checks import positive_int
from .._half import Float32Inside
from .predictor import allowed_pairs, distance_bucket

__all__ = ["SparseAdaptiveAttention"]


class SparseAdaptiveAttention(Float32Inside, Attention):
    """Sparse Adaptive Connection (Li et al. 2020), simplified: each query attends the keys a learned predictor picks.

    The edge predictor scores every (query, key) pair of a head with a low-rank
    bilinear form plus a learned encoding of the distance (Li et al.'s
    distance encodings)::

        e_ij = (q_i P_h) · (k_j Q_h) / sqrt(r) + d_h[bucket(|i - j|)]

    and each query keeps its ``num_edges`` best-scoring allowed keys (its
    edges). Attention is softmax over the edges only, with the predictor's
    score added to the logit, ``softmax_j∈edges(i)(scale · q_i · k_j + e_ij)``:
    this is how the predictor is trained here, by the task loss through the
    edges it chose (a pathwise gradient), where the paper trains an LSTM edge
    predictor with REINFORCE (the task loss as reward). See
    docs/mechanisms/sparse-adaptive.md for exactly what is simplified.

    Cost: the predictor is ``O(L·S·r)`` (r = ``predictor_dim``, small; in query
    chunks of ``chunk_size``, so memory ``O(chunk_size·S)``), the attention
    ``O(L·num_edges·D)``.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.
    Masks: causal (self-attention, L == S) and key padding; cross-attention (L != S) without causal.

    Args:
        num_heads: H.
        head_dim: D (the predictor's input size).
        num_edges: keys per query, >= 1.
        predictor_dim: r, the rank of the predictor's bilinear form.
        distance_buckets: number of log2 distance buckets of the distance encoding.
        chunk_size: queries per chunk of the predictor.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.

    Raises:
        InvalidInputError: any of the int options not a positive int.
    """

    def __init__(self, *, num_heads: int, head_dim: int, num_edges: int = 8, predictor_dim: int = 8,
                 distance_buckets: int = 16, chunk_size: int = 256, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=positive_int("num_heads", num_heads), head_dim=positive_int("head_dim", head_dim),
                         scale=scale, backend=backend)
        self.num_edges = positive_int("num_edges", num_edges)
        self.predictor_dim = positive_int("predictor_dim", predictor_dim)
        self.distance_buckets = positive_int("distance_buckets", distance_buckets)
        self.chunk_size = positive_int("chunk_size", chunk_size)
        H, D, r = self.num_heads, self.head_dim, self.predictor_dim
        self.pred_q = nn.Parameter(torch.randn(H, D, r) / math.sqrt(D))
        self.pred_k = nn.Parameter(torch.randn(H, D, r) / math.sqrt(D))
        self.distance_encoding = nn.Parameter(torch.zeros(H, self.distance_buckets))

    def edge_scores(self, q: Tensor, kr: Tensor, rows: Tensor, S: int, L: int) -> Tensor:
        """Predictor scores ``(B, H, R, S)`` of the query rows ``rows`` (``q`` holds those rows) against all keys."""
        qr = torch.einsum("bhld,hdr->bhlr", q, self.pred_q.to(q.dtype))
        e = torch.matmul(qr, kr.transpose(-1, -2)) / math.sqrt(self.predictor_dim)
        d = (rows[:, None] + (S - L) - torch.arange(S, device=q.device)[None, :]).abs()
        bias = self.distance_encoding.to(q.dtype)[:, distance_bucket(d, self.distance_buckets)]  # (H, R, S)
        return e + bias[None]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        B, H, L, _ = q.shape
        S = k.shape[2]
        kr = torch.einsum("bhsd,hdr->bhsr", k, self.pred_k.to(k.dtype))
        if symbolic(L, S):
            return self._attend_dynamic(q, k, v, kr, ctx)
        kk = min(self.num_edges, S)
        outs = []
        for c0 in range(0, L, self.chunk_size):
            rows = torch.arange(c0, min(c0 + self.chunk_size, L), device=q.device)
            qc = q[:, :, c0:c0 + len(rows)]
            e = self.edge_scores(qc, kr, rows, S, L)
            keep = allowed_pairs(rows, S, L, causal=ctx.causal, key_padding_mask=ctx.key_padding_mask)
            e = e.masked_fill(~keep, float("-inf"))
            ev, idx = e.topk(kk, dim=-1)                                       # (B, H, R, kk)
            valid = ev != float("-inf")
            flat = idx.reshape(B, H, -1, 1)
            ks = k.gather(2, flat.expand(-1, -1, -1, k.shape[-1])).view(B, H, len(rows), kk, -1)
            vs = v.gather(2, flat.expand(-1, -1, -1, v.shape[-1])).view(B, H, len(rows), kk, -1)
            s = (qc[..., None, :] * ks).sum(-1) * ctx.scale + torch.where(valid, ev, torch.zeros_like(ev))
            s = s.masked_fill(~valid, float("-inf"))
            any_ = valid.any(-1, keepdim=True)
            w = torch.softmax(torch.where(any_, s, torch.zeros_like(s)), dim=-1) * any_
            outs.append((w[..., None] * vs).sum(-2))
        return torch.cat(outs, dim=2)

    def _attend_dynamic(self, q: Tensor, k: Tensor, v: Tensor, kr: Tensor, ctx: CallContext) -> Tensor:
        """:meth:`_attend` for a length ``torch.export`` traces as dynamic: one program for every length.

        All query rows in one chunk (a loop over ``ceil(L / chunk_size)`` chunks would fix the length; the
        predictor scores are then ``O(L·S)``), and ``num_edges`` columns of ``-inf`` appended to the scores so
        that ``topk`` always takes ``num_edges`` (not ``min(num_edges, S)``): the appended edges are invalid
        like the masked ones (weight 0; their index is clamped to a real key for the gather), so the output is
        the eager one.
        """
        B, H, L, _ = q.shape
        S = k.shape[2]
        kk = self.num_edges
        rows = torch.arange(L, device=q.device)
        e = self.edge_scores(q, kr, rows, S, L)
        keep = allowed_pairs(rows, S, L, causal=ctx.causal, key_padding_mask=ctx.key_padding_mask)
        e = F.pad(e.masked_fill(~keep, float("-inf")), (0, kk), value=float("-inf"))
        ev, idx = e.topk(kk, dim=-1)                                           # (B, H, L, kk)
        valid = ev != float("-inf")
        flat = idx.clamp(max=S - 1).reshape(B, H, -1, 1)
        ks = k.gather(2, flat.expand(-1, -1, -1, k.shape[-1])).view(B, H, L, kk, -1)
        vs = v.gather(2, flat.expand(-1, -1, -1, v.shape[-1])).view(B, H, L, kk, -1)
        s = (q[..., None, :] * ks).sum(-1) * ctx.scale + torch.where(valid, ev, torch.zeros_like(ev))
        s = s.masked_fill(~valid, float("-inf"))
        any_ = valid.any(-1, keepdim=True)
        w = torch.softmax(torch.where(any_, s, torch.zeros_like(s)), dim=-1) * any_
        return (w[..., None] * vs).sum(-2)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_edges={self.num_edges}, predictor_dim={self.predictor_dim}"
