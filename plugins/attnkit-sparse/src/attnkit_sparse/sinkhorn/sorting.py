"""Sinkhorn attention's sorting: block summaries, the learned sorting network, Gumbel-Sinkhorn, sorted blocks.

Shared by the module and its reference. ``L`` is padded at the end to
``NB·b`` rows (``b = block_size``) with zero rows, which are never keys of
their own block and add zero vectors to the sorted blocks' mixtures.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit import transforms
from attnkit.first_order import first_order

__all__ = ["pad_blocks", "sort_matrix", "sorted_blocks", "own_and_sorted", "sinkhorn"]


def pad_blocks(x: Tensor, b: int) -> Tensor:
    """``(B, H, L, F)`` zero-padded at the end to a multiple of ``b`` rows."""
    pad = -x.shape[2] % b
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def sinkhorn(logits: Tensor, iters: int, causal: bool, *, scaling: bool = False) -> Tensor:
    """``(..., NB, NB)`` -> the (soft) sorting matrix.

    Bidirectional: ``iters`` alternating row and column normalisations in log
    space (a doubly stochastic matrix in the limit); ``scaling``: the same
    iterations in the exponential domain where the logits' range allows
    (:func:`_sinkhorn_scaling`, what the module runs), else in log space. Causal: row ``i`` may only
    take blocks ``j < i`` and is normalised over its row only (a column
    normalisation would let later blocks change earlier rows); row 0 is zero.
    """
    if causal:
        nb = logits.shape[-1]
        allowed = torch.ones(nb, nb, dtype=torch.bool, device=logits.device).tril(-1)
        z = logits.masked_fill(~allowed, float("-inf"))
        has = allowed.any(-1, keepdim=True)
        return torch.softmax(z.masked_fill(~has, 0.0), -1) * has
    # torch.func transforms and torch.export: the log-domain iterations (plain torch ops, no branch on the values)
    if scaling and not transforms.plain_torch():
        p = _sinkhorn_scaling(logits, iters)
        if p is not None:
            return p
    z = logits
    for _ in range(iters):
        z = z - torch.logsumexp(z, -1, keepdim=True)
        z = z - torch.logsumexp(z, -2, keepdim=True)
    return z.exp()


#: the exponent range the scaling form accepts (each row's logits within this of the row's maximum): every
#: ``exp`` is then a normal float, far from underflow; beyond it, the log-domain iterations run instead
SCALING_RANGE = {torch.float32: 60.0, torch.float64: 600.0, torch.float16: 8.0, torch.bfloat16: 60.0}


def _sinkhorn_scaling(logits: Tensor, iters: int) -> Tensor | None:
    """The same iterations in the exponential domain (Sinkhorn-Knopp): ``P = exp(z - rowmax)``, then ``iters``
    times ``P /= rowsum; P /= colsum``. ``log`` of each step is the log-domain step exactly (a row or
    column normalisation subtracts the same constant from the row or column), so the results agree to
    rounding. The normalisations are carried as two scaling vectors, ``P = diag(a) K diag(b)`` with
    ``a = 1/(K b)``, ``b = 1/(Kᵀ a)`` (:class:`_SinkhornKnopp`): one ``exp``, two matrix-vector products per
    iteration and one product at the end, with a backward of its own through the vectors (the elementwise
    form's autograd made ~6 full passes per iteration, most of a training step's sorting time). None (use the
    log domain) when some logit lies further than :data:`SCALING_RANGE` below its row's maximum, or when a
    scaling vector or the result is not finite and positive."""
    if iters < 1:   # no normalisation to cancel the row maxima
        return None
    z = logits - logits.detach().amax(-1, keepdim=True)
    lim = SCALING_RANGE.get(logits.dtype)
    if lim is None or not bool(torch.isfinite(z).all()) or float(z.detach().amin()) < -lim:
        return None
    p = _SinkhornKnopp.apply(z, iters)
    return p if p is not None and bool(torch.isfinite(p.detach()).all()) else None


class _SinkhornKnopp(torch.autograd.Function):
    """``P = diag(a_T) K diag(b_T)`` for ``K = exp(z)`` and ``a_t = 1/(K b_{t-1})``, ``b_t = 1/(Kᵀ a_t)``
    (``b_0 = 1``), which is ``T`` alternating row and column normalisations of ``K``. Backward through the
    vectors: with ``M = G ∘ K``, ``∂b_T = Mᵀ a_T``, ``∂a_T = M b_T``; per step, from the last,
    ``∂c_t = −∂b_t b_t²``, ``∂a_t += K ∂c_t``, ``∂r_t = −∂a_t a_t²``, ``∂b_{t−1} = Kᵀ ∂r_t``, and
    ``∂K = G ∘ a_T b_Tᵀ + Σ_t (a_t ∂c_tᵀ + ∂r_t b_{t−1}ᵀ)`` (one batched product of ``T``-row factors),
    ``∂z = ∂K ∘ K``. Forward returns None when a scaling vector is not finite and positive.

    The vectors are carried as rows ``(..., 1, NB)``, every product a row times a matrix (``Kv = (vᵀ Kᵀ)ᵀ``):
    torch's batched product of a matrix and a column vector took 0.40 ms at ``(8, 256, 256)``, a row vector
    times the matrix (or its transposed view) 0.05 ms (session 65; 16 of them per forward)."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, iters: int) -> Tensor | None:
        K = z.exp()
        KT = K.transpose(-1, -2)
        b = torch.ones(z.shape[:-2] + (1, z.shape[-1]), dtype=z.dtype, device=z.device)   # rows (..., 1, NB)
        As, Bs = [], [b]
        for _ in range(iters):
            a = torch.matmul(b, KT).reciprocal_()        # aᵀ = 1 / (K b)ᵀ
            b = torch.matmul(a, K).reciprocal_()         # bᵀ = 1 / (Kᵀ a)ᵀ
            As.append(a)
            Bs.append(b)
        A, Bv = torch.cat(As, -2), torch.cat(Bs, -2)               # (..., T, NB), (..., T + 1, NB)
        if not (bool(torch.isfinite(A).all()) and bool(torch.isfinite(Bv).all()) and bool((A > 0).all())
                and bool((Bv > 0).all())):
            return None
        p = K * a.transpose(-1, -2) * b
        ctx.save_for_backward(K, A, Bv)
        return p

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        K, A, Bv = ctx.saved_tensors
        T = A.shape[-2]
        KT = K.transpose(-1, -2)
        aT, bT = A[..., T - 1:T, :], Bv[..., T:T + 1, :]
        M = g * K
        db = torch.matmul(aT, M)                           # (Mᵀ a_T)ᵀ
        da_p = torch.matmul(bT, M.transpose(-1, -2))       # (M b_T)ᵀ
        dC, dR = torch.empty_like(A), torch.empty_like(A)
        for t in range(T, 0, -1):
            at, bt = A[..., t - 1:t, :], Bv[..., t:t + 1, :]
            dc = -db * bt * bt
            da = torch.matmul(dc, KT)                      # (K ∂c)ᵀ
            if t == T:
                da = da + da_p
            dr = -da * at * at
            dC[..., t - 1:t, :] = dc
            dR[..., t - 1:t, :] = dr
            if t > 1:
                db = torch.matmul(dr, K)                   # (Kᵀ ∂r)ᵀ
        low = torch.matmul(torch.cat([A, dR], -2).transpose(-1, -2), torch.cat([dC, Bv[..., :T, :]], -2))
        return (g * aT.transpose(-1, -2) * bT + low) * K, None


def _buffer(like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """An uninitialised tensor of ``like``'s dtype and device: on the CPU in float32/float64 a buffer of
    :mod:`attnkit.cpu_buffers`, reused once nothing refers to it (these are ``2·B·H·L·D`` floats, 64 MiB at
    L = 16,384, H = 8, D = 64: fresh from ``mmap`` on every call, their page faults took 17 of the 57 ms of
    ``own_and_sorted`` there); else (other devices and dtypes, ``torch.compile`` tracing) ``new_empty``."""
    if like.device.type == "cpu" and like.dtype in (torch.float32, torch.float64) \
            and not torch.compiler.is_compiling():
        from attnkit import cpu_buffers

        return torch.from_numpy(cpu_buffers.empty(shape, "float32" if like.dtype == torch.float32 else "float64"))
    return like.new_empty(shape)


def _plain_block_sums(x: Tensor, b: int) -> Tensor:
    B, H, _, F = x.shape
    return pad_blocks(x, b).reshape(B, H, -1, b, F).sum(3)


class _BlockSums(torch.autograd.Function):
    """``(B, H, NB, F)`` sums of the blocks of ``b`` rows of ``x (B, H, L, F)`` (zero-padded at the end); the
    backward writes each block's gradient row ``b`` times into one buffer (:func:`_buffer`). Autograd's own
    backward of ``reshape(...).sum(3)`` materialised the broadcast gradient in a fresh ``(B, H, L, F)`` tensor:
    14 ms at L = 16,384, H = 8, F = 64, mostly its page faults (session 65)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, b: int) -> Tensor:
        ctx.shape, ctx.b = tuple(x.shape), b
        return _plain_block_sums(x, b)

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        B, H, L, F = ctx.shape
        b = ctx.b
        nb = g.shape[2]
        dx = _buffer(g, (B, H, nb * b, F))
        dx.view(B, H, nb, b, F).copy_(g.unsqueeze(3))
        return (dx if nb * b == L else dx[:, :, :L]), None


def block_sums(x: Tensor, b: int) -> Tensor:
    """``(B, H, NB, F)``: the sums of ``x``'s blocks of ``b`` rows, ``pad_blocks(x, b).reshape(B, H, NB, b, F)
    .sum(3)`` (differentiable)."""
    if transforms.plain_torch():   # torch.func / torch.export: plain torch ops
        return _plain_block_sums(x, b)
    return _BlockSums.apply(x, b)


def sort_matrix(k: Tensor, weight: Tensor, b: int, *, temperature: float, iters: int, causal: bool,
                noise: Tensor | None = None, scaling: bool = False) -> Tensor:
    """``(B, H, NB, NB)`` sorting matrix from the keys ``k`` ``(B, H, L, D)`` (unpadded).

    Block summaries ``X_i`` = mean of the block's real keys (causal: of the blocks before it, so a row
    never sees its own block's future); logits ``R_ij = (X_i W)·X_j / sqrt(D)`` with the learned
    ``weight`` ``(H', D, D)``; ``(R + noise) / temperature`` through :func:`sinkhorn`.
    """
    B, H, L, D = k.shape
    nb = math.ceil(L / b)
    counts = torch.full((nb,), float(b), dtype=k.dtype, device=k.device)
    counts[-1] = L - (nb - 1) * b
    summ = block_sums(k, b)                                               # (B, H, NB, D)
    if causal:   # block i is summarised by blocks 0..i-1 (their mean; zero for block 0)
        csum = torch.cumsum(summ, 2) - summ
        ccount = torch.cumsum(counts, 0) - counts
        x = csum / ccount.clamp(min=1).view(1, 1, nb, 1)
    else:
        x = summ / counts.view(1, 1, nb, 1)
    logits = torch.einsum("bhid,hde,bhje->bhij", x, weight.expand(H, D, D), x) / math.sqrt(D)
    if noise is not None:
        logits = logits + noise
    return sinkhorn(logits / temperature, iters, causal, scaling=scaling)


def sorted_blocks(x: Tensor, s: Tensor, b: int) -> Tensor:
    """``(B, H, NB·b, F)``: block ``i`` = ``Σ_j s[i, j] · block j`` of ``x`` ``(B, H, L, F)`` (zero-padded)."""
    B, H, _, F = x.shape
    nb = s.shape[-1]
    xb = pad_blocks(x, b).reshape(B, H, nb, b * F)
    return torch.matmul(s, xb).view(B, H, nb * b, F)


class _OwnAndSorted(torch.autograd.Function):
    """``[x (zero-padded to NB·b rows); S · blocks(x)]`` written into one buffer (:func:`_buffer`): no ``cat`` copy
    in the forward, no split in the backward (``d x = g_own + Sᵀ g_sorted``, ``d S = g_sorted · blocks(x)ᵀ``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, s: Tensor, b: int) -> Tensor:
        B, H, L, F = x.shape
        nb = s.shape[-1]
        n = nb * b
        out = _buffer(x, (B, H, 2 * n, F))
        out[:, :, :L] = x
        if n > L:
            out[:, :, L:n] = 0
        xb = out[:, :, :n].reshape(B, H, nb, b * F)       # the padded blocks, read back from the buffer
        for i in range(B):
            for h in range(H):
                torch.mm(s[i, h], xb[i, h], out=out[i, h, n:].view(nb, b * F))
        ctx.save_for_backward(x, s)
        ctx.b = b
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, s = ctx.saved_tensors
        b = ctx.b
        B, H, L, F = x.shape
        nb = s.shape[-1]
        n = nb * b
        gs = g[:, :, n:].reshape(B, H, nb, b * F)
        dx = ds = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(s.transpose(-1, -2), gs, out=_buffer(gs, (B, H, nb, b * F))).view(B, H, n, F)
            dx = dx.add_(g[:, :, :n])[:, :, :L]   # in place: no second (B, H, L, F) tensor
        if ctx.needs_input_grad[1]:
            ds = torch.matmul(gs, pad_blocks(x, b).reshape(B, H, nb, b * F).transpose(-1, -2))
        return dx, ds, None


def own_and_sorted(x: Tensor, s: Tensor, b: int) -> Tensor:
    """``(B, H, 2·NB·b, F)``: ``torch.cat([pad_blocks(x, b), sorted_blocks(x, s, b)], 2)`` in one buffer
    (differentiable in ``x`` and ``s``)."""
    if transforms.plain_torch():   # torch.func / torch.export: plain torch ops
        return torch.cat([pad_blocks(x, b), sorted_blocks(x, s, b)], 2)
    return _OwnAndSorted.apply(x, s, b)
