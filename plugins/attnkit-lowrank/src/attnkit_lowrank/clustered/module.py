"""``clustered`` and ``improved-clustered``: clustered attention (Vyas, Katharopoulos, Fleuret 2020), torch path.

Queries are grouped into C clusters: each query is hashed to ``bits`` signs
of random projections (hyperplanes drawn from ``seed``), and K-means with
Hamming distance runs ``iterations`` Lloyd steps on the hash codes (centroid
codes by majority vote, ties to the lower cluster; initial centroids are the
codes of C evenly spaced queries). The centroid of a cluster is the mean of
its queries; it attends to every key with softmax and every member query
receives the centroid's output. O(L·C·bits + C·S·D) instead of O(L·S·D).

``improved-clustered`` keeps for each cluster the ``top_k`` keys its centroid
weights most; each query then attends exactly (its own softmax) over those
keys, scaled by the centroid's total weight on them, plus the centroid's
weights on every other key (the paper's i-clustered).

With as many clusters as queries (and distinct hash codes) every query is
its own centroid: exact softmax attention. The clustering (hashes,
assignments) carries no gradient; centroids are means of the queries, so
gradients reach every query through its centroid.
"""

from __future__ import annotations

import torch
from torch import Tensor

import attnkit
from attnkit import InvalidInputError
from attnkit.caching import outside_trace

from ..common import Float32Inside, check_int
from ..plugin import CLUSTERED, IMPROVED_CLUSTERED

DEFAULT_CLUSTERS, DEFAULT_TOP_K = 100, 32        # the paper's


def hyperplanes(seed: int, bits: int, D: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(D, bits)`` Gaussian projections from ``torch.Generator().manual_seed(seed)``."""
    with outside_trace():   # seeded draws of the shape: under torch.export a constant, not a generator op
        g = torch.Generator().manual_seed(seed)
        return torch.randn(D, bits, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def cluster(q: Tensor, C: int, bits: int, iterations: int, seed: int) -> Tensor:
    """Cluster index ``(B, H, L)`` of each query: LSH codes, then Hamming K-means (no gradient).

    Codes are kept as +-1, so the Hamming distance is ``(bits - x·c) / 2``: one
    product per Lloyd step; the centroid codes are majority votes of per-cluster
    bit counts summed with ``index_add``.
    """
    B, H, L, D = q.shape
    with torch.no_grad():
        codes = torch.where(q @ hyperplanes(seed, bits, D, q.dtype, q.device) > 0, 1.0, -1.0).to(q.dtype)
        init = torch.div(torch.arange(C, device=q.device) * L, C, rounding_mode="floor")
        cent = codes[:, :, init]                                                     # (B, H, C, bits)
        assign = nearest(codes, cent)
        base = (torch.arange(B * H, device=q.device) * C)[:, None]
        flat_codes = codes.reshape(B * H * L, bits)
        for _ in range(iterations):
            idx = (assign.reshape(B * H, L) + base).flatten()
            total = torch.zeros(B * H * C, bits, dtype=q.dtype, device=q.device).index_add_(0, idx, flat_codes)
            count = torch.bincount(idx, minlength=B * H * C).view(B, H, C, 1)
            total = total.view(B, H, C, bits)
            new = torch.where(total > 0, 1.0, -1.0).to(q.dtype)       # majority of +1 (a tie votes -1: bit 0)
            cent = torch.where(count > 0, new, cent)                  # an empty cluster keeps its code
            assign = nearest(codes, cent)
    return assign


def nearest(codes: Tensor, cent: Tensor) -> Tensor:
    """Index of the nearest centroid code (Hamming distance = (bits - codes·cent)/2; ties to the lower index)."""
    return (codes @ cent.transpose(-1, -2)).argmax(-1)


def centroids(q: Tensor, assign: Tensor, C: int) -> tuple[Tensor, Tensor]:
    """Mean query of each cluster ``(B, H, C, D)`` (0 for an empty one) and the one-hot ``(B, H, L, C)``."""
    onehot = torch.nn.functional.one_hot(assign, C).to(q.dtype)
    count = onehot.sum(2).clamp(min=1)
    return (onehot.transpose(-1, -2) @ q) / count[..., None], onehot


def masked_scores(s: Tensor, keep: Tensor | None) -> Tensor:
    return s if keep is None else s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)


class ClusteredAttention(Float32Inside, attnkit.Attention):
    """Clustered attention: queries grouped by hashed K-means, each cluster's centroid attends for its members.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` ->
    ``(B, H, L, E)``. Non-causal (also cross-attention), key padding (padded
    keys get no weight; a row with no real key gives 0). Queries interact.

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        clusters: number of clusters C, taken literally: more than L is an
            error. None (default): the paper's 100, or L for fewer queries.
        bits: hash bits per query (the paper's 63).
        iterations: Lloyd iterations of the Hamming K-means (the paper's 10).
        seed: seed of the hash hyperplanes.

    Raises:
        InvalidInputError: an option of the wrong type or out of range; at
            call time more clusters than queries.
        UnsupportedFeatureError: causal, ``attn_mask``, other mask kinds.
    """

    option_constraints = {"clusters": {"minimum": 1}, "bits": {"minimum": 1}, "iterations": {"minimum": 0},
                          "seed": {"minimum": 0}}
    capabilities = CLUSTERED.capabilities
    refusal_reasons = {
        "causal": "a cluster mixes queries from the whole sequence, so its centroid would see future keys",
        "attn_mask": "a per-pair mask cannot be applied to a centroid shared by several queries",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", clusters: int | None = None, bits: int = 63, iterations: int = 10,
                 seed: int = 0) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.clusters = check_int("clusters", clusters, allow_none=True)
        self.bits = check_int("bits", bits)
        self.iterations = check_int("iterations", iterations, minimum=0)
        self.seed = check_int("seed", seed, minimum=0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, clusters={self.clusters}, bits={self.bits}, iterations={self.iterations}"

    def cluster_count(self, L: int) -> int:
        """C for L queries: ``clusters`` (refused when it outnumbers them) or min(100, L)."""
        if self.clusters is None:
            return min(DEFAULT_CLUSTERS, L)
        self._check_lengths(L, L)
        return self.clusters

    def _check_lengths(self, L: int, S: int) -> None:
        if self.clusters is not None and self.clusters > L:
            raise InvalidInputError(f"clusters: {self.clusters} clusters outnumber the L={L} queries; expected "
                                    f"clusters <= {L}")

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        self._check_lengths(q.shape[2], k.shape[2])
        C = self.cluster_count(q.shape[2])
        keep = ctx.key_padding_mask
        assign = cluster(q, C, self.bits, self.iterations, self.seed)
        qc, onehot = centroids(q, assign, C)
        a = torch.softmax(masked_scores(qc @ (ctx.scale * k).transpose(-1, -2), keep), -1)      # (B, H, C, S)
        out_c = a @ v
        if keep is not None:
            out_c = out_c * keep.any(-1)[:, None, None, None].to(out_c.dtype)
        return onehot @ out_c


class ImprovedClusteredAttention(ClusteredAttention):
    """Improved clustered attention: clustered attention plus each query's exact softmax over its cluster's top-k keys.

    Shapes and capabilities as for ``clustered``.

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        clusters: number of clusters C, taken literally: more than L is an
            error. None (default): the paper's 100, or L for fewer queries.
        bits: hash bits per query (the paper's 63).
        iterations: Lloyd iterations of the Hamming K-means (the paper's 10).
        seed: seed of the hash hyperplanes.
        top_k: keys per cluster attended exactly, taken literally: more than S
            is an error. None (default): the paper's 32, or S for fewer keys.

    Raises:
        InvalidInputError: an option of the wrong type or out of range; at
            call time more clusters than queries or top_k above S.
        UnsupportedFeatureError: causal, ``attn_mask``, other mask kinds.
    """

    option_constraints = {"top_k": {"minimum": 1}}
    capabilities = IMPROVED_CLUSTERED.capabilities

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", clusters: int | None = None, bits: int = 63, iterations: int = 10,
                 seed: int = 0, top_k: int | None = None) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend, clusters=clusters,
                         bits=bits, iterations=iterations, seed=seed)
        self.top_k = check_int("top_k", top_k, allow_none=True)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, top_k={self.top_k}"

    def top_k_count(self, S: int) -> int:
        """Keys per cluster for S keys: ``top_k`` (refused above S) or min(32, S)."""
        return min(DEFAULT_TOP_K, S) if self.top_k is None else self.top_k

    def _check_lengths(self, L: int, S: int) -> None:
        super()._check_lengths(L, S)
        if self.top_k is not None and self.top_k > S:
            raise InvalidInputError(f"top_k: {self.top_k} keys per cluster outnumber the S={S} keys; expected "
                                    f"top_k <= {S}")

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        B, H, L, D = q.shape
        S, E = k.shape[2], v.shape[-1]
        self._check_lengths(L, S)
        C, T = self.cluster_count(L), self.top_k_count(S)
        keep = ctx.key_padding_mask
        assign = cluster(q, C, self.bits, self.iterations, self.seed)
        qc, onehot = centroids(q, assign, C)
        sc = masked_scores(qc @ (ctx.scale * k).transpose(-1, -2), keep)                       # (B, H, C, S)
        a = torch.softmax(sc, -1)
        if keep is not None:
            a = a * keep[:, None, None, :].to(a.dtype)          # a row with no real key: all 0
        # the top-k by score, not by weight: the same keys in exact arithmetic, but weights that underflow to 0
        # (large-norm inputs in float32) would tie and the choice among them would be arbitrary
        top = sc.detach().topk(T, -1).indices                   # (B, H, C, T)
        in_top = torch.zeros_like(a, dtype=torch.bool).scatter(-1, top, True)
        mass = (a * in_top).sum(-1, keepdim=True)               # (B, H, C, 1): centroid weight on its top-k
        rest = (a * ~in_top) @ v                                # centroid weights on the other keys
        # each query: exact softmax over its cluster's top-k keys (the cluster's T keys copied per query)
        BH = B * H
        rows = (assign.reshape(BH, L) + (torch.arange(BH, device=q.device) * C)[:, None]).flatten()
        top_flat = top.reshape(B, H, C * T)
        kt = k.gather(2, top_flat[..., None].expand(B, H, C * T, D)).view(BH * C, T, D).index_select(0, rows)
        vt = v.gather(2, top_flat[..., None].expand(B, H, C * T, E)).view(BH * C, T, E).index_select(0, rows)
        s = torch.bmm(kt, (ctx.scale * q).reshape(BH * L, D, 1)).view(B, H, L, T)
        if keep is not None:
            kt_keep = keep[:, None, :].expand(B, H, S).gather(2, top_flat).view(BH * C, T).index_select(0, rows)
            kt_keep = kt_keep.view(B, H, L, T)
            s = s.masked_fill(~kt_keep, torch.finfo(s.dtype).min)
            p = torch.softmax(s, -1) * kt_keep
        else:
            p = torch.softmax(s, -1)
        exact = torch.bmm(p.reshape(BH * L, 1, T), vt).view(B, H, L, E)
        return onehot @ rest + (onehot @ mass) * exact
