"""``sinkhorn``: Sparse Sinkhorn attention (Tay et al. 2020) on the block-sparse engine."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit import Attention
from attnkit.caching import cached
from attnkit.context import CallContext
from attnkit.errors import InvalidInputError

from .._half import is_half
from ..base import check_int, content_backend_order
from .sorting import own_and_sorted, pad_blocks, sort_matrix

__all__ = ["SinkhornAttention"]


class SinkhornAttention(Attention):
    """Sparse Sinkhorn attention: each query block attends its own block and one sorted key block.

    The sequence is cut into blocks of ``block_size`` (the end padded with
    zero rows to a multiple: never keys of their own block, zero vectors in
    the mixtures). A learned sorting network scores block pairs,
    ``R_ij = (X_i W)·X_j / sqrt(D)`` on block summaries ``X`` (the mean of a
    block's keys), and Gumbel-Sinkhorn turns ``(R + Gumbel noise) /
    temperature`` into a soft block permutation ``S`` by ``sinkhorn_iters``
    row/column normalisations (noise only in training; eval is deterministic).
    Sorted block ``i`` is ``Σ_j S_ij · block j`` of the keys and of the values.
    Query block ``i`` attends, in one softmax, its own block and sorted block ``i``.

    Causal (the paper's causal variant, made strictly causal): a block's
    summary is the mean of the blocks before it, row ``i`` of ``S`` may only
    take blocks ``j < i`` and is normalised over its row only (column
    normalisation would mix in later rows), block 0 has no sorted block, and
    the own block is attended up to the query. One block (``L <= block_size``):
    exact softmax attention (its sorted block is itself, every key counted
    twice, which a softmax does not see).

    The sorting network's weight is a parameter ``(H, D, D)`` (``num_heads``
    given) or ``(1, D, D)``: ``head_dim`` is required. It scores block
    summaries bilinearly, so any length works (the paper's feed-forward
    SortNet outputs a fixed number of blocks).

    Half precision: float16/bfloat16 inputs get their sorting matrix (block summaries, the sorting
    network's scores, Sinkhorn's iterations) and their mixed sorted blocks in float32; the weight is
    used in float32 whatever its own dtype (``module.to(torch.bfloat16)`` stores it in bfloat16, like any
    parameter) and its gradient arrives in its own dtype.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, E)`` -> ``(B, H, L, E)`` (L = S).

    Args:
        block_size: rows per block b (an int >= 1); cost O(L·2b·D + (L/b)²·D). Default 64.
        temperature: Gumbel-Sinkhorn temperature (a float > 0). Default 0.75.
        sinkhorn_iters: row/column normalisation rounds (an int >= 1). Default 8.
        seed: seed of the sorting network's initial weight (an int >= 0). Default 0.
        num_heads: number of heads H; when given, one sorting network per head.
        head_dim: head dimension D (required: the sorting network's weight is D x D).
        scale: multiplier of q·k; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU kernels), "torch" (any device) or "triton" (CUDA kernels
            for the attention inside the reordered blocks; block sizes powers of two >= 16). ``auto`` picks
            triton on CUDA for float16/bfloat16 inputs (measured faster than torch there), torch for float32.

    Raises:
        InvalidInputError: an option out of range or a missing head_dim (named).
        UnsupportedFeatureError: key padding and other masks (causal only), cross-attention, positions.
    """

    option_constraints: ClassVar[dict[str, dict[str, Any]]] = {
        "block_size": {"minimum": 1}, "sinkhorn_iters": {"minimum": 1}, "seed": {"minimum": 0},
        "temperature": {"minimum": 0, "exclusive_minimum": True},
        "backend": {"choices": ("auto", "numba", "torch", "triton")},
    }
    refusal_reasons: ClassVar[dict[str, str]] = {
        "cross": "blocks of queries are sorted against blocks of the same sequence (self-attention)",
        "key_padding_mask": "sorted blocks mix whole blocks by absolute position: a padded key cannot be made "
                            "absent; pad to a multiple of block_size and mask the loss instead",
        "attn_mask": "the attended pairs come from the block permutation; only causal composes with it",
    }

    def __init__(self, *, block_size: int = 64, temperature: float = 0.75, sinkhorn_iters: int = 8, seed: int = 0,
                 num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.block_size = check_int("block_size", block_size)
        self.sinkhorn_iters = check_int("sinkhorn_iters", sinkhorn_iters)
        self.seed = check_int("seed", seed, minimum=0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
                or not math.isfinite(temperature):
            raise InvalidInputError(f"temperature: expected a finite float > 0, got {temperature!r}")
        self.temperature = float(temperature)
        if head_dim is None:
            raise InvalidInputError("head_dim: sinkhorn's sorting network has a learned (D, D) weight; expected "
                                    "head_dim (an int >= 1), got None")
        g = torch.Generator().manual_seed(self.seed)
        hs = num_heads if num_heads is not None else 1
        w = torch.eye(head_dim, dtype=torch.float64) + torch.randn(hs, head_dim, head_dim, generator=g,
                                                                    dtype=torch.float64) / math.sqrt(head_dim)
        self.sort_weight = nn.Parameter(w.to(torch.get_default_dtype()))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block_size={self.block_size}, temperature={self.temperature}, "
                f"sinkhorn_iters={self.sinkhorn_iters}")

    def sort_matrix(self, k: Tensor, *, causal: bool, scaling: bool = True) -> Tensor:
        """``(B, H, NB, NB)`` block sorting matrix for keys ``k`` (Gumbel noise in training only); ``scaling``:
        Sinkhorn's iterations in the exponential domain where the logits' range allows (the reference
        runs them in log space, ``scaling=False``)."""
        b = min(self.block_size, k.shape[2])
        nb = -(-k.shape[2] // b)
        noise = None
        if self.training:
            u = torch.rand(k.shape[0], k.shape[1], nb, nb, dtype=k.dtype, device=k.device)
            noise = -torch.log((-torch.log(u.clamp(1e-20, 1.0))).clamp(min=1e-20))   # Gumbel(0, 1)
        return sort_matrix(k, self.sort_weight.to(k.dtype), b, temperature=self.temperature,
                           iters=self.sinkhorn_iters, causal=causal, noise=noise, scaling=scaling)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state.pop("_plans", None)                                         # cached plans: rebuilt on demand
        return state

    def _plan(self, L: int, b: int, causal: bool, device: torch.device) -> Any:
        """The engine's plan: query block ``i`` x (its own block ``i``, sorted block ``i``), with the element masks
        (never the end padding; causal: the own block up to the query, no sorted block for block 0). It
        depends on ``L``, ``b`` and ``causal`` only: cached."""
        L, b = int(L), int(b)   # dynamic sizes of a torch.export trace: the plan follows them (the trace specialises)
        # cached: never an inference tensor a later training call would meet, nor a fake one (torch.export: it
        # depends on the shape only, so it is built on real tensors and becomes a constant of the program), nor a
        # torch.func transform's wrapper
        return cached(self.__dict__.setdefault("_plans", {}), (L, b, causal, str(device)),
                      lambda: self._build_plan(L, b, causal, device), limit=8)

    @staticmethod
    def _build_plan(L: int, b: int, causal: bool, device: torch.device) -> Any:
        from ..engine import explicit_plan

        nb = -(-L // b)
        n = torch.arange(nb, device=device)
        kv_idx = torch.stack([n, n + nb], -1).view(1, 1, nb, 2)
        i = torch.arange(b, device=device).view(b, 1)
        j = torch.arange(b, device=device).view(1, b)
        own = ((n.view(nb, 1, 1) * b + j) < L).expand(nb, b, b)             # never the end padding
        if causal:
            own = own & (j <= i)
        srt = torch.ones(nb, b, b, dtype=torch.bool, device=device)
        if causal:
            srt[0] = False
        bank = torch.stack([own, srt], 1).view(1, 1, nb, 2, b, b)
        return explicit_plan(kv_idx, bank, nb * b, 2 * nb * b)

    def backend_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """``auto``: triton first for half inputs on CUDA (measured), see :func:`..base.content_backend_order`."""
        return content_backend_order(tuple(self.caps.backends), device, dtype, self.block_size)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        from ..engine import attend_plan

        dtype = q.dtype
        if is_half(dtype) and ctx.backend != "triton":
            # numba and torch compute in float32 anyway: sort, mix and attend there, cast the output back
            return self._attend(q.float(), k.float(), v.float(), ctx).to(dtype)
        B, H, L, _ = q.shape
        b = min(self.block_size, L)
        if is_half(dtype):
            # triton: the sorting matrix and the mixed blocks in float32, rounded to half for the kernels
            kf, vf = k.float(), v.float()
            s = self.sort_matrix(kf, causal=ctx.causal)
            kx, vx = own_and_sorted(kf, s, b).to(dtype), own_and_sorted(vf, s, b).to(dtype)
        else:
            s = self.sort_matrix(k, causal=ctx.causal)
            kx = own_and_sorted(k, s, b)                                        # (B, H, 2·NB·b, D)
            vx = own_and_sorted(v, s, b)
        plan = self._plan(L, b, ctx.causal, q.device)
        out = attend_plan(pad_blocks(q, b), kx, vx, plan, scale=ctx.scale, backend=ctx.backend)
        return out[:, :, :L]
