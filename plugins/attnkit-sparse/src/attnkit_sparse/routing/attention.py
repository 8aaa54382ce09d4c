"""``routing``: Routing Transformer attention (online k-means, balanced clusters) on the block-sparse engine.

The routed queries and keys of each cluster are gathered (cluster ``c`` is
block ``c`` of a sequence of ``num_clusters·W`` rows), the engine runs the
block-diagonal plan (block ``c`` x block ``c``, element masks: used entries,
causal by original positions), and the clusters that routed a query are
combined by their log-sum-exp. See :mod:`.clusters` and the reference in :mod:`.naive`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit import Attention
from attnkit.caching import cached, may_keep
from attnkit.context import CallContext
from attnkit.errors import InvalidInputError
from attnkit.recompute import recomputing
from attnkit.transforms import plain_torch

from .._half import is_half, wide
from ..base import check_int, content_backend_order
from .clusters import route, unit
from .fused import attend_clusters, use_fused

__all__ = ["RoutingAttention"]


class RoutingAttention(Attention):
    """Routing attention (Roy, Saffar, Vaswani, Grangier 2021): attend within online k-means clusters.

    ``num_clusters`` unit centroids live in the space queries and keys share
    (``q̂ = q/‖q‖``, ``k̂ = k/‖k‖``). Each cluster routes the
    ``w = max(1, ceil(n / num_clusters))`` queries and the ``w`` keys closest
    to its centroid (top-k per centroid: balanced clusters; ``n`` real
    positions; padded positions are never routed, as keys or as queries, so
    their outputs are 0 and padded keys count as absent). A query attends, with the softmax of
    ``scale·q·k``, the keys of every cluster that routed it (several clusters:
    one softmax over the union, a key counted once per cluster); a query no
    cluster routed, or with no allowed key, gives 0 — the paper mixes routing
    heads with local heads for that reason. ``causal``: only keys at earlier or
    equal original positions. One cluster: every position is routed, exact
    softmax attention.

    Centroids are a buffer (``centroids``, ``(H, num_clusters, D)`` with
    ``num_heads`` given, else ``(1, num_clusters, D)`` shared by the heads),
    random unit vectors from ``seed``, created when ``head_dim`` is known
    (at build, or at the first call). In training every forward updates them by
    an exponential moving average of the unit queries and keys assigned to
    them (nearest centroid): ``μ ← normalise(decay·μ + (1 - decay)·mean)``;
    in eval they are frozen. In training the commitment term
    ``mean ‖x̂ - μ(x̂)‖²`` over the routed space (queries and keys, centroids
    held constant) is recorded as the auxiliary loss ``routing_commitment``
    (``attnkit.aux_losses(model)``).

    Half precision: float16/bfloat16 inputs are routed in float32 (unit vectors, scores, top-k) and the
    centroids stay a float32 buffer under ``module.to(torch.float16)`` / ``.half()`` / ``.bfloat16()``
    (an EMA of decay 0.999 is lost in half: its steps round away); float64 still converts them.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, E)`` -> ``(B, H, L, E)`` (L = S).

    Args:
        num_clusters: number of clusters k (an int >= 1); cost O(L·(L/k)·D). Default 16.
        decay: EMA decay of the centroids in training (a float in [0, 1)). Default 0.999.
        sync_centroids: under torch.distributed (DDP), all-reduce each training step's cluster sums
            and counts over the default process group before the EMA update, so every rank's centroids
            follow the global batch, as ``nn.SyncBatchNorm`` does for batch statistics. Every rank must
            then run the same number of training forwards. A no-op without an initialised process group.
            Default False: each rank's centroids follow its own batch (they drift apart under DDP unless
            ``broadcast_buffers=True``, which copies rank 0's).
        seed: seed of the initial centroids (an int >= 0). Default 0.
        num_heads: number of heads H; when given, one set of centroids per head.
        head_dim: head dimension D; when given, the centroids are created at build.
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU kernels), "torch" (any device) or "triton" (CUDA kernels
            for the attention inside the reordered blocks; block sizes powers of two >= 16). ``auto`` picks
            triton on CUDA for float16/bfloat16 inputs (measured faster than torch there), torch for float32.

    Raises:
        InvalidInputError: an option out of range (named); inputs whose D differs from the centroids'.
        UnsupportedFeatureError: masks other than causal and key padding, cross-attention, positions.
    """

    option_constraints: ClassVar[dict[str, dict[str, Any]]] = {
        "num_clusters": {"minimum": 1}, "seed": {"minimum": 0},
        "decay": {"minimum": 0, "maximum": 1, "exclusive_maximum": True},
        "backend": {"choices": ("auto", "numba", "torch", "triton")},
    }
    refusal_reasons: ClassVar[dict[str, str]] = {
        "cross": "queries and keys are routed as the same positions (self-attention)",
        "attn_mask": "the attended pairs come from the clusters; only causal and key padding compose with them",
    }

    def __init__(self, *, num_clusters: int = 16, decay: float = 0.999, seed: int = 0,
                 sync_centroids: bool = False, num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        if not isinstance(sync_centroids, bool):
            raise InvalidInputError(f"sync_centroids: expected a bool, got {sync_centroids!r}")
        self.sync_centroids = sync_centroids
        self.num_clusters = check_int("num_clusters", num_clusters)
        self.seed = check_int("seed", seed, minimum=0)
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise InvalidInputError(f"decay: expected a float in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.register_buffer("centroids", None)
        if head_dim is not None:
            self.centroids = self._initial(head_dim, torch.device("cpu"), torch.get_default_dtype())

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``module.to(...)``, ``.half()``, ``.cuda()``: the centroids follow the device, and any dtype but a half
        one (a half cast leaves them float32: see the class docstring)."""
        before = self.centroids
        out = super()._apply(fn, recurse)
        after = self.centroids
        if before is not None and after is not None and is_half(after.dtype):
            self._buffers["centroids"] = before.to(device=after.device, dtype=wide(before.dtype))
        return out

    def _initial(self, D: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        hc = self.num_heads if self.num_heads is not None else 1
        g = torch.Generator().manual_seed(self.seed)   # on the CPU even under torch.device("meta") (a meta build)
        return unit(torch.randn(hc, self.num_clusters, D, generator=g, dtype=torch.float64, device="cpu")
                    ).to(device, dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_clusters={self.num_clusters}, decay={self.decay}, seed={self.seed}"
                + (", sync_centroids=True" if self.sync_centroids else ""))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state.pop("_plans", None)                                         # cached plans: rebuilt on demand
        state.pop("_first_run_centroids", None)                           # only a recomputation reads them
        return state

    def centroids_for(self, q: Tensor) -> Tensor:
        """The centroids ``(H, num_clusters, D)`` for inputs like ``q`` (created at the first call if needed)."""
        H, D = q.shape[1], q.shape[-1]
        if self.centroids is None:
            self.centroids = self._initial(D, q.device, wide(q.dtype))
        if self.centroids.shape[-1] != D:
            raise InvalidInputError(f"q: the centroids have head_dim {self.centroids.shape[-1]}, got D={D}")
        return self.centroids.to(wide(q.dtype)).expand(H, -1, -1)   # half inputs are routed in float32

    def _routing_centroids(self, q: Tensor) -> Tensor:
        """The centroids this call routes with: :meth:`centroids_for`, except in a forward that activation
        checkpointing runs again during backward, which gets them as they were when that forward first ran
        (its EMA update has changed the buffer since; routing with the new ones would give other clusters, and
        gradients of a different function). In training the result is a private copy (``(H, C, D)``), which the
        commitment loss keeps while the EMA updates the buffer in place; each training forward keeps its copy (the
        last 8), and a recomputation takes the newest (backward recomputes the last forward first)."""
        cents = self.centroids_for(q)
        if not self.training:
            return cents
        if torch.compiler.is_compiling() or not may_keep():   # (nor a torch.func transform's wrapper kept)
            return cents.detach().clone()
        kept = self.__dict__.setdefault("_first_run_centroids", collections.deque(maxlen=8))
        if recomputing():
            return kept.pop() if kept and kept[-1].shape == cents.shape else cents.detach().clone()
        kept.append(cents.detach().clone())
        return kept[-1]

    def _update(self, q: Tensor, k: Tensor, kpm: Tensor | None, near: tuple[Tensor, Tensor],
                cents: Tensor) -> None:
        """EMA update (training) and the commitment loss, from the nearest centroids ``near`` ``(B, H, L)`` of the
        queries and keys (read off the routing scores).

        One pass per side sums the unit vectors of each (head, cluster), ``S_c``; it gives the EMA's
        means (detached) and the commitment term without gathering a centroid per token:
        ``Σ_i ‖x̂_i − μ_c(i)‖² = Σ_i ‖x̂_i‖² − 2 Σ_c μ_c·S_c + Σ_c n_c ‖μ_c‖²`` (centroids held constant, so its
        gradient is ``2 (x̂_i − μ_c(i))``). On CPU a numba kernel per side with its own backward
        (:func:`.gather.commitment`); elsewhere, and under ``torch.func`` transforms or a ``torch.export`` trace,
        ``index_add`` under autograd (:meth:`_commitment_torch`).
        """
        mu = cents   # (H, C, D): _routing_centroids' private copy (the loss keeps it; the EMA updates the buffer)
        if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and _numba_ok() and not plain_torch():
            from .gather import commitment
            loss, sums, counts = commitment(q, k, near, kpm, mu)     # one numba pass per side, its own backward
        else:
            loss, sums, counts = self._commitment_torch(q, k, kpm, near, mu)
        total = counts.sum()
        self.record_aux_loss("routing_commitment", loss / total.clamp(min=1))
        if recomputing():
            return                  # the first run of this forward updated the centroids
        with torch.no_grad():
            sums = sums.detach()
            if self.sync_centroids and dist.is_available() and dist.is_initialized():
                both = torch.cat([sums, counts], -1)
                dist.all_reduce(both)                                       # the global batch's sums and counts
                sums, counts = both[..., :-1], both[..., -1:]
            if self.centroids.shape[0] == 1:
                sums, counts = sums.sum(0, keepdim=True), counts.sum(0, keepdim=True)
            old = self.centroids.to(q.dtype)
            mean = sums / counts.clamp(min=1)
            new = unit(self.decay * old + (1 - self.decay) * mean)
            self.centroids.copy_(torch.where(counts > 0, new, old).to(self.centroids.dtype))

    @staticmethod
    def _commitment_torch(q: Tensor, k: Tensor, kpm: Tensor | None, near: tuple[Tensor, Tensor], mu: Tensor
                          ) -> tuple[Tensor, Tensor, Tensor]:
        """``(Σ_i ‖x̂_i − μ_c(i)‖², sums (H, C, D), counts (H, C, 1))`` by ``index_add`` (any device)."""
        B, H, L, D = q.shape
        C = mu.shape[1]
        hc = (torch.arange(H, device=q.device) * C).view(1, H, 1)
        dump = H * C                                                     # padded positions land in a dropped row
        sums = torch.zeros(H * C + 1, D, dtype=q.dtype, device=q.device)
        counts = torch.zeros(H * C + 1, dtype=q.dtype, device=q.device)
        sq = q.new_zeros(())
        for x, nr in ((unit(q), near[0]), (unit(k), near[1])):
            idx = nr + hc
            if kpm is not None:
                idx = torch.where(kpm[:, None, :], idx, torch.full_like(idx, dump))
            idx = idx.reshape(-1)
            xf = x.reshape(B * H * L, D)
            sums = sums.index_add(0, idx, xf)
            counts = counts.index_add(0, idx, torch.ones_like(idx, dtype=q.dtype))
            n2 = (x * x).sum(-1)
            sq = sq + (n2 if kpm is None else torch.where(kpm[:, None, :], n2, torch.zeros_like(n2))).sum()
        sums, counts = sums[:H * C].view(H, C, D), counts[:H * C].view(H, C, 1)
        loss = sq - 2 * (mu * sums).sum() + (counts * (mu * mu).sum(-1, keepdim=True)).sum()
        return loss, sums, counts

    def backend_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """``auto``: triton first for half inputs on CUDA (measured), see :func:`..base.content_backend_order`."""
        return content_backend_order(tuple(self.caps.backends), device, dtype, None)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        if is_half(q.dtype):
            if ctx.backend != "triton":   # numba and torch compute in float32 anyway: route, attend, combine there
                return self._attend(q.float(), k.float(), v.float(), ctx).to(q.dtype)
            # triton: routing and the centroids' update in float32, half operands to the kernels, the clusters
            # combined in float32
            return self._attend_clusters(q, k, v, ctx).to(q.dtype)
        return self._attend_clusters(q, k, v, ctx)

    def _attend_clusters(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        B, H, L, D = q.shape
        E = v.shape[-1]
        kpm = ctx.key_padding_mask
        kpm = None if kpm is None else kpm.to(q.device)
        cents = self._routing_centroids(q)
        # (B, H, C, W); the nearest centroids (a fifth entry) only for the training update (0.2 ms a 16K sequence
        # and side)
        routed = route(q, k, cents, kpm, nearest=self.training)
        qi, qok, ki, kok = routed[:4]
        C, W = qi.shape[2], qi.shape[3]
        if ctx.backend == "triton" and (W < 16 or W & (W - 1)):
            # the triton kernels take blocks of a power of two >= 16 rows: each cluster gets unused slots (index 0,
            # masked out as query and as key) up to that size, which the bank below excludes
            qi, qok, ki, kok = _pad_slots(qi, qok, ki, kok, max(16, 1 << (W - 1).bit_length()))
            W = qi.shape[3]
            padded = True
        else:
            padded = False
        # triton tiles a cluster wider than 64 rows (16K tokens in 16 clusters: 1,024) into 64 x 64 blocks: one
        # 1,024-row block would be one kernel tile, which the compiler cannot build in reasonable time
        tile = min(W, _TRITON_TILE) if ctx.backend == "triton" else W
        if ctx.backend == "numba" and use_fused(B * H, W):
            plan = None                                     # the fused kernels read the clusters directly
        elif kpm is None and not ctx.causal and not padded:   # every slot used: one all-true bank for all heads
            plan = self._full_plan(C, W, tile, q.device)
        else:
            bank = qok[..., :, None] & kok[..., None, :]
            if ctx.causal:
                bank = bank & (ki[..., None, :] <= qi[..., :, None])
            if torch.compiler.is_exporting():
                # the tiles are the clusters' blocks whatever the data: the shape's plan, with the data's masks
                plan = _with_bank(self._full_plan(C, W, tile, q.device, tuple(bank.shape[:2])), bank, tile)
            else:
                plan = _cluster_plan(bank, tile)
        if ctx.backend == "numba" and use_fused(B * H, W):
            out = attend_clusters(q, k, v, qi, qok, ki, kok, causal=ctx.causal, scale=ctx.scale)
        elif ctx.backend == "numba":
            out = self._gather_attend_combine_numba(q, k, v, qi, qok, ki, plan, ctx.scale)
        else:
            out = self._gather_attend_combine_torch(q, k, v, qi, qok, ki, plan, ctx.scale, ctx.backend)
        if self.training:
            self._update(q.to(wide(q.dtype)), k.to(wide(k.dtype)), kpm, routed[4], cents)
        return out.view(B, H, L, E)

    def _full_plan(self, C: int, W: int, tile: int, device: torch.device,
                   dims: tuple[int, int] = (1, 1)) -> Any:
        """The block-diagonal plan of ``C`` clusters of ``W`` rows with no element mask (index dims ``dims``),
        cached: without causal or key padding every routed slot is used and every pair of a cluster attended."""
        # cached: never an inference tensor a later training call would meet, nor (torch.export) a fake one, nor
        # a torch.func transform's wrapper
        return cached(self.__dict__.setdefault("_plans", {}), (C, W, tile, str(device), dims),
                      lambda: _cluster_plan(torch.ones(*dims, C, W, W, dtype=torch.bool, device=device), tile),
                      limit=8)

    def _gather_attend_combine_numba(self, q: Tensor, k: Tensor, v: Tensor, qi: Tensor, qok: Tensor, ki: Tensor,
                                     plan: Any, scale: float) -> Tensor:
        """The CPU path: routed gathers and the combination as numba kernels (:mod:`.gather`)."""
        from ..engine import attend_plan
        from .gather import combine_routed, gather_routed

        B, H, L, D = q.shape
        E = v.shape[-1]
        M = qi.shape[2] * qi.shape[3]
        qf, kf = qi.reshape(B * H, M), ki.reshape(B * H, M)
        qs = gather_routed(q.reshape(B * H, L, D), qf).view(B, H, M, D)
        ks = gather_routed(k.reshape(B * H, L, D), kf).view(B, H, M, D)
        vs = gather_routed(v.reshape(B * H, L, E), kf).view(B, H, M, E)
        out_s, lse_s = attend_plan(qs, ks, vs, plan, scale=scale, backend="numba", return_lse=True)
        lse_s = torch.where(qok.reshape(B, H, M), lse_s, torch.full_like(lse_s, float("-inf")))
        return combine_routed(out_s.view(B * H, M, E), lse_s.view(B * H, M), qf, L)

    def _gather_attend_combine_torch(self, q: Tensor, k: Tensor, v: Tensor, qi: Tensor, qok: Tensor, ki: Tensor,
                                     plan: Any, scale: float, backend: str) -> Tensor:
        """Any device: ``index_select`` gathers, the combination by ``scatter_reduce`` / ``index_add``."""
        from ..engine import attend_plan

        B, H, L, D = q.shape
        E = v.shape[-1]
        C, W = qi.shape[2], qi.shape[3]
        off = (torch.arange(B * H, device=q.device) * L).view(B, H, 1, 1)
        qf, kf = (qi + off).reshape(-1), (ki + off).reshape(-1)
        qs = q.reshape(B * H * L, D).index_select(0, qf).view(B, H, C * W, D)
        ks = k.reshape(B * H * L, D).index_select(0, kf).view(B, H, C * W, D)
        vs = v.reshape(B * H * L, E).index_select(0, kf).view(B, H, C * W, E)
        out_s, lse_s = attend_plan(qs, ks, vs, plan, scale=scale, backend=backend, return_lse=True)
        # back to positions: the clusters that routed a query, combined by their log-sum-exp
        lse_s = torch.where(qok.reshape(B, H, C * W), lse_s, torch.full_like(lse_s, float("-inf")))
        dest = qf.view(B, H, C * W)                                       # flat rows of (B·H·L)
        acc = lse_s.dtype                                                  # float32 for half inputs
        m = torch.full((B * H * L,), float("-inf"), dtype=acc, device=q.device)
        m = m.scatter_reduce(0, dest.reshape(-1), lse_s.detach().reshape(-1), "amax")
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(lse_s.reshape(-1) - m[dest.reshape(-1)])            # 0 where unused or empty
        num = torch.zeros(B * H * L, E, dtype=acc, device=q.device).index_add(
            0, dest.reshape(-1), w[:, None] * out_s.reshape(-1, E).to(acc))
        den = torch.zeros(B * H * L, dtype=acc, device=q.device).index_add(0, dest.reshape(-1), w)
        return num / torch.where(den > 0, den, torch.ones_like(den))[:, None]


def _numba_ok() -> bool:
    from ..engine import why_unavailable
    return why_unavailable("numba", "cpu") is None


#: the largest block the triton kernels get from routing (a cluster wider than this is tiled)
_TRITON_TILE = 64


def _cluster_plan(bank: Tensor, tile: int) -> Any:
    """The block-diagonal plan of ``C`` clusters from their element masks ``bank`` ``(B', H', C, W, W)`` (query
    slot x key slot), each cluster cut into ``(W / tile)**2`` blocks of ``tile x tile``: query block ``i`` of
    cluster ``c`` visits the cluster's key blocks ``c·n .. c·n + n - 1`` (``n = W / tile``)."""
    from ..engine import explicit_plan

    bp, hp, C, W, _ = bank.shape
    n = W // tile
    blocks = (bank.view(bp, hp, C, n, tile, n, tile).permute(0, 1, 2, 3, 5, 4, 6)
              .reshape(bp, hp, C * n, n, tile, tile))
    first = torch.arange(C, device=bank.device).repeat_interleave(n) * n          # (C·n,): the cluster's first block
    kv_idx = (first[:, None] + torch.arange(n, device=bank.device)).expand(bp, hp, C * n, n)
    return explicit_plan(kv_idx, blocks, C * W, C * W)


def _with_bank(plan: Any, bank: Tensor, tile: int) -> Any:
    """``plan`` (:func:`_cluster_plan` of an all-true bank of ``bank``'s shape: every tile of every cluster, in the
    same order) with the element masks ``bank`` ``(B', H', C, W, W)``; nothing read from the data (torch.export)."""
    from ..engine.plan import _spans

    bp, hp, C, W, _ = bank.shape
    n = W // tile
    flat = (bank.view(bp, hp, C, n, tile, n, tile).permute(0, 1, 2, 3, 5, 4, 6)
            .reshape(bp * hp * C * n * n, tile, tile).contiguous())
    return dataclasses.replace(plan, bank=flat, span=_spans(flat), attended_pairs=None, _numpy=None, _int8_bank=None,
                               _key_major=None)


def _pad_slots(qi: Tensor, qok: Tensor, ki: Tensor, kok: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each cluster's ``(B, H, C, W)`` slots widened to ``width`` with unused slots (position 0, not ok)."""
    pad = width - qi.shape[-1]
    grow = (lambda t: torch.nn.functional.pad(t, (0, pad)))
    return grow(qi), grow(qok), grow(ki), grow(kok)
