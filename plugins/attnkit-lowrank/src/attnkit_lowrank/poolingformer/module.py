"""``poolingformer``: :class:`PoolingformerAttention`, two-level pooling attention (Zhang et al. 2021).

Each query i gets the sum of two softmax attentions over the same q, k, v:

* level 1, a sliding window: keys j with ``|i - j| <= window // 2``
  (causal: ``0 <= i - j <= window // 2``);
* level 2, a larger window of pooled keys and values: segment p covers
  positions ``[p·stride, min(p·stride + pool_size, S))`` (the means of k and of
  v over it; ``ceil((S - pool_size) / stride) + 1`` segments, one segment of
  all keys when ``S < pool_size``); query i sees the segments that overlap
  ``[i - pool_window // 2, i + pool_window // 2]`` (causal: that end at or
  before i and overlap ``[i - pool_window // 2, i]``; none for the first
  ``pool_size - 1`` queries, whose level 2 output is 0).

``out_i = y_i + z_i`` as in the paper. In the paper the second level has its
own projections (its queries are a projection of the first level's output);
the attention contract takes q, k, v already projected, so both levels use
them. Query chunks slice only the keys and segments they can see:
O(L·(window + pool_window / stride)·D) time, no L x S matrix. While
``torch.export`` traces a dynamic length (no key padding) the chunks run
batched (:meth:`PoolingformerAttention._levels_batched`), one program for every length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit
from attnkit import InvalidInputError
from attnkit.errors import UnsupportedFeatureError
from attnkit.transforms import batched, symbolic

from ..common import Float32Inside, check_int, window_count
from ..plugin import POOLINGFORMER


def segments(S: int, size: int, stride: int) -> tuple[Tensor, Tensor]:
    """Start and end ``(P,)`` of the pooling segments of ``S`` keys (end exclusive, clipped to S)."""
    P = 1 if S <= size else math.ceil((S - size) / stride) + 1
    start = torch.arange(P) * stride
    return start, torch.clamp(start + size, max=S)


def pool(x: Tensor, size: int, stride: int) -> Tensor:
    """Segment means of ``x`` ``(B, H, S, C)`` -> ``(B, H, P, C)`` (see :func:`segments`)."""
    B, H, S, C = x.shape
    if S <= size:
        return x.mean(2, keepdim=True)
    flat = x.reshape(B * H, S, C).transpose(1, 2)
    out = torch.nn.functional.avg_pool1d(flat, size, stride, ceil_mode=True, count_include_pad=False)
    return out.transpose(1, 2).reshape(B, H, -1, C)


def segment_count(S: int, size: int, stride: int) -> int:
    """The number of :func:`segments` of ``S`` keys, ``ceil(max(S - size, 0) / stride) + 1``; for a length
    ``torch.export`` traces as dynamic an unbacked size of its own (read with ``.item()``, ``>= 1``), as
    :func:`attnkit.transforms.chunk_count` (the backed expression would draw guards on S)."""
    if not symbolic(S):
        return 1 if S <= size else math.ceil((S - size) / stride) + 1
    n = torch.scalar_tensor(S, dtype=torch.int64).clamp(min=size).sub(size).add(stride - 1).div(
        stride, rounding_mode="floor").add(1).item()
    torch._check(n >= 1)
    torch._check((n - 1) * stride < S)
    return n


def pool_gathered(x: Tensor, start: Tensor, size: int) -> Tensor:
    """Means of ``x`` ``(B, H, S, C)`` over ``[start_p, min(start_p + size, S))`` for each start ``(P,)`` ->
    ``(B, H, P, C)``: :func:`pool` by gathering the segments (no branch on S: the dynamic-length form)."""
    S = x.shape[2]
    idx = start[:, None] + torch.arange(size, device=x.device)                   # (P, size)
    inside = idx < S
    parts = x.index_select(2, torch.clamp(idx, max=S - 1).flatten()).unflatten(2, idx.shape)
    return (parts * inside[..., None].to(x.dtype)).sum(3) / inside.sum(-1, keepdim=True).to(x.dtype)


def _softmax_rows(s: Tensor, keep: Tensor, v: Tensor) -> Tensor:
    """Masked row softmax times v; rows with nothing kept give 0."""
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
    return (torch.softmax(s, -1) * keep) @ v


class PoolingformerAttention(Float32Inside, attnkit.Attention):
    """Poolingformer: a sliding window plus a larger window of pooled keys and values, outputs summed.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, E)`` ->
    ``(B, H, L, E)``. Self-attention only (L == S), non-causal and causal.

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of ``q·k`` in both levels; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        window: first-level window w1 (keys within ``window // 2`` of the query).
        pool_window: second-level window w2 (segments overlapping ``pool_window // 2`` around the query).
        pool_size: pooling kernel (segment length).
        pool_stride: pooling stride; must not exceed ``pool_size`` (no key outside every segment).
        chunk_size: queries per chunk.

    Raises:
        InvalidInputError: an option of the wrong type or out of range; a
            pooling stride larger than the pooling size; a pooling size larger
            than the pooling window.
        UnsupportedFeatureError: ``attn_mask``, L != S.

    Key padding (``key_padding_mask`` ``(B, S)``, True = real key): padded keys
    are removed, not masked in place: each batch row's kept keys are numbered
    0..c-1 in order and both levels (windows and pooling segments) are those
    of that shorter sequence, so a real query's output equals the output for
    the sequence without its padded tokens, whatever the padded keys hold. A
    query sits at the rank of the last kept key at or before it (-1 before
    the first: causal, it sees nothing and gives 0); a row with no kept key
    gives 0.
    """

    option_constraints = {"window": {"minimum": 1}, "pool_window": {"minimum": 1}, "pool_size": {"minimum": 1},
                          "pool_stride": {"minimum": 1}, "chunk_size": {"minimum": 1}}
    capabilities = POOLINGFORMER.capabilities
    refusal_reasons = {
        "attn_mask": "a per-pair mask does not apply to pooled segments",
        "cross": "the windows are centred on the query's own position: self-attention only",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", window: int = 128, pool_window: int = 512, pool_size: int = 5,
                 pool_stride: int = 4, chunk_size: int = 256) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = check_int("window", window)
        self.pool_window = check_int("pool_window", pool_window)
        self.pool_size = check_int("pool_size", pool_size)
        self.pool_stride = check_int("pool_stride", pool_stride)
        self.chunk_size = check_int("chunk_size", chunk_size)
        if pool_stride > pool_size:
            raise InvalidInputError(f"pool_stride: a stride of {pool_stride} skips keys between segments of "
                                    f"pool_size={pool_size}; expected pool_stride <= pool_size")
        if pool_size > pool_window:
            raise InvalidInputError(f"pool_size: a segment of {pool_size} keys does not fit in the second-level "
                                    f"window; expected pool_size <= pool_window={pool_window}")

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, window={self.window}, pool_window={self.pool_window}, "
                f"pool_size={self.pool_size}, pool_stride={self.pool_stride}")

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        L = q.shape[2]
        keep = ctx.key_padding_mask
        kq = ctx.scale * k
        if keep is None and (symbolic(L) or torch.compiler.is_exporting()):
            # (a static export too: the chunk loop's host lists of ranks become unbacked symbols in the trace,
            # which made one export take 15-30 s at L = 9)
            return self._levels_batched(q, kq, v, ctx.causal)
        if keep is None:
            return self._levels(q, kq, v, torch.arange(L, device=q.device), ctx.causal)
        # key padding: each batch row attends over its kept keys only, numbered 0..c-1 in order (padded keys
        # are removed, not zeroed: the windows and segments are those of the sequence without them)
        if batched(keep):
            raise UnsupportedFeatureError(
                self.impl_name, "a key_padding_mask batched by torch.func.vmap",
                "its windows and pooled segments are those of each sequence without its padded keys, a shape that "
                "differs from sample to sample, which vmap cannot batch",
                instead="Pass one key_padding_mask for every vmapped sample (not batched), or loop over the samples")
        outs = []
        for b in range(q.shape[0]):
            idx = keep[b].nonzero().flatten()
            rank = keep[b].long().cumsum(0) - 1          # a query's rank: that of the last kept key at or before it
            if idx.numel() == 0:
                outs.append(v.new_zeros(1, v.shape[1], L, v.shape[-1]))
                continue
            outs.append(self._levels(q[b:b + 1], kq[b:b + 1, :, idx], v[b:b + 1, :, idx], rank, ctx.causal))
        return torch.cat(outs, 0)

    def _levels(self, q: Tensor, kq: Tensor, v: Tensor, rank: Tensor, causal: bool) -> Tensor:
        """Both levels for queries ``q`` ``(B, H, L, D)`` at key ranks ``rank`` ``(L,)`` over ``c`` keys.

        ``kq`` ``(B, H, c, D)`` (scaled) and ``v`` ``(B, H, c, E)`` are the keys at
        positions 0..c-1; ``rank`` is non-decreasing, in ``[-1, c - 1]`` (the
        position of each query among the keys; ``arange(L)`` without padding).
        """
        L, c = q.shape[2], kq.shape[2]
        r1, r2 = self.window // 2, self.pool_window // 2
        kp, vp = pool(kq, self.pool_size, self.pool_stride), pool(v, self.pool_size, self.pool_stride)
        start, end = (t.to(q.device) for t in segments(c, self.pool_size, self.pool_stride))
        P = start.shape[0]
        ranks = rank.tolist()
        size = self.chunk_size
        firsts, lasts = ranks[::size], ranks[size - 1::size] + ([ranks[-1]] if L % size else [])
        # each chunk's key window [lo1, hi1) and segment window [lo2, hi2), gathered for all chunks at once
        # (one index_select each, unbound per chunk): slicing per chunk made the backward write a whole
        # (B, H, c, D) zero tensor per chunk, quadratic in L
        lo1 = [max(0, ra - r1) for ra in firsts]
        hi1 = [max(lo, rb + 1 if causal else min(c, rb + r1 + 1)) for lo, rb in zip(lo1, lasts)]
        lo2 = [max(0, (ra - r2 - self.pool_size) // self.pool_stride) for ra in firsts]
        hi2 = [max(lo, min(P, (rb + r2) // self.pool_stride + 1)) for lo, rb in zip(lo2, lasts)]

        def windows(lo: list[int], hi: list[int], n: int) -> tuple[Tensor, Tensor]:
            width = max(1, max(h - lo_ for lo_, h in zip(lo, hi)))
            idx = torch.tensor(lo, device=q.device)[:, None] + torch.arange(width, device=q.device)
            valid = idx < torch.tensor(hi, device=q.device)[:, None]
            return idx.clamp(max=max(n - 1, 0)), valid                        # (chunks, width)

        idx1, valid1 = windows(lo1, hi1, c)
        idx2, valid2 = windows(lo2, hi2, P)

        def gather(x: Tensor, idx: Tensor) -> tuple[Tensor, ...]:
            if x.shape[2] == 0:      # no keys: every window is empty (all masked below)
                x = x.new_zeros(*x.shape[:2], 1, x.shape[3])
            return x.index_select(2, idx.flatten()).unflatten(2, idx.shape).unbind(2)

        k1, v1, k2, v2 = gather(kq, idx1), gather(v, idx1), gather(kp, idx2), gather(vp, idx2)
        outs = []
        for n, (qc, i) in enumerate(zip(q.split(size, 2), rank.split(size))):
            i = i[:, None]
            j = idx1[n][None, :]
            keep1 = valid1[n] & (i - j <= r1) & ((j <= i) if causal else (j - i <= r1))
            y = _softmax_rows(qc @ k1[n].transpose(-1, -2), keep1, v1[n])
            s_, e_ = start[idx2[n]][None, :], end[idx2[n]][None, :] - 1            # inclusive ends
            keep2 = valid2[n] & (e_ >= i - r2) & ((e_ <= i) if causal else (s_ <= i + r2))
            z = _softmax_rows(qc @ k2[n].transpose(-1, -2), keep2, v2[n])
            outs.append(y + z)
        return torch.cat(outs, 2)

    def _levels_batched(self, q: Tensor, kq: Tensor, v: Tensor, causal: bool) -> Tensor:
        """:meth:`_levels` without key padding for a length ``torch.export`` traces as dynamic: the same windows,
        segments and chunks, batched (the chunk loop and the host lists of :meth:`_levels` would fix the length).

        ``N = chunk_count(L, chunk_size)`` query chunks, each with a fixed-width window of keys (the widest any
        chunk can have: ``chunk_size + window // 2``, twice ``window // 2`` non-causal) and of segments; the
        ``P`` segments (an unbacked count, :func:`segment_count`) are gathered means. The masks are
        :meth:`_levels`' with rank ``arange(L)``; columns past a chunk's window are masked as there (the same
        output, summed over more zero weights). Memory O(L·(window + pool_window / pool_stride)) as there.
        """
        B, H, L, _ = q.shape
        r1, r2 = self.window // 2, self.pool_window // 2
        size, ps, st = self.chunk_size, self.pool_size, self.pool_stride
        dev = q.device
        P = segment_count(L, ps, st)
        start = torch.arange(P, device=dev) * st
        end = torch.clamp(start + ps, max=L)
        kp, vp = pool_gathered(kq, start, ps), pool_gathered(v, start, ps)
        N = window_count(L, size)
        first = torch.arange(N, device=dev) * size                     # each chunk's first and last query
        last = torch.clamp(first + size - 1, max=L - 1)
        lo1 = torch.clamp(first - r1, min=0)
        hi1 = torch.maximum(lo1, last + 1 if causal else torch.clamp(last + r1 + 1, max=L))
        lo2 = torch.clamp(torch.div(first - r2 - ps, st, rounding_mode="floor"), min=0)
        hi2 = torch.maximum(lo2, torch.clamp(torch.div(last + r2, st, rounding_mode="floor") + 1, max=P))
        # the widest windows: hi1 - lo1 <= size + r1 (+ r1 non-causal); hi2 - lo2 <= (size - 1 + 2 r2 + ps) // st
        # + 2 (floor(b / st) - floor(a / st) <= floor((b - a) / st) + 1)
        w1 = size + r1 if causal else size + 2 * r1
        w2 = (size - 1 + 2 * r2 + ps) // st + 2
        idx1 = lo1[:, None] + torch.arange(w1, device=dev)                # (N, w1)
        valid1, idx1 = idx1 < hi1[:, None], torch.clamp(idx1, max=L - 1)
        idx2 = lo2[:, None] + torch.arange(w2, device=dev)                # (N, w2)
        valid2, idx2 = idx2 < hi2[:, None], torch.clamp(idx2, max=P - 1)

        def gather(x: Tensor, idx: Tensor) -> Tensor:
            return x.index_select(2, idx.flatten()).unflatten(2, idx.shape)          # (B, H, N, width, C)

        qs = F.pad(q, (0, 0, 0, N * size - L)).unflatten(2, (N, size))          # (B, H, N, size, D)
        i = torch.arange(N * size, device=dev).view(N, size, 1)                  # query positions
        j = idx1[:, None, :]
        keep1 = valid1[:, None, :] & (i - j <= r1) & ((j <= i) if causal else (j - i <= r1))
        y = _softmax_rows(qs @ gather(kq, idx1).transpose(-1, -2), keep1, gather(v, idx1))
        s_, e_ = start[idx2][:, None, :], end[idx2][:, None, :] - 1                 # inclusive ends
        keep2 = valid2[:, None, :] & (e_ >= i - r2) & ((e_ <= i) if causal else (s_ <= i + r2))
        z = _softmax_rows(qs @ gather(kp, idx2).transpose(-1, -2), keep2, gather(vp, idx2))
        return (y + z).flatten(2, 3)[:, :, :L]
