"""``nystrom``: :class:`NystromAttention` (Nystromformer, Xiong et al. 2021), the torch path.

Three softmax kernels through ``m`` landmarks, never an ``L x S`` matrix::

    F = softmax(scale · Q K~^T)          (L, m)
    A = softmax(scale · Q~ K~^T)         (m, m)
    G = softmax(scale · Q~ K^T)          (m, S)   padded keys excluded
    out = F (Z (G V)),  Z = iterative pseudo-inverse of A

``Q~`` are the segment means of the queries, ``K~`` the segment means of the
real (not padded) keys (:func:`attnkit_lowrank.common.segment_weights`). With
``conv_kernel_size`` a depthwise convolution of V along the sequence (one
kernel per head, as in the paper's code) is added to the output.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit
from attnkit import InvalidInputError, transforms
from attnkit.first_order import first_order

from ..common import (
    Float32Inside,
    Scratch,
    assert_at_least,
    capped_count,
    check_int,
    chunk_rows,
    grad_like,
    nystrom_pinv,
    segment_weights,
    shortest_lengths,
    softmax_attend,
)
from ..plugin import NYSTROM

DEFAULT_LANDMARKS = 64        # the paper's


def landmarks(x: Tensor, keep: Tensor | None, m: int) -> Tensor:
    """``m`` segment means of ``x`` ``(B, H, n, D)`` over the kept tokens -> ``(B, H, m, D)``."""
    B, _, n, _ = x.shape
    if keep is None and not transforms.symbolic(n, m) and n % m == 0:
        # sum, then divide the small (m, D) result: mean's backward divided and materialised an (n, D)
        # gradient (two passes at 16K x 8 heads); sum's backward is an expand
        return x.unflatten(2, (m, n // m)).sum(3) / (n // m)
    return segment_weights(keep, B, n, m, x.dtype, x.device) @ x


def check_landmarks(name: str, m: int, L: int, S: int) -> None:
    """InvalidInputError when ``m`` landmarks outnumber the ``L`` queries or the ``S`` keys."""
    if m > L or m > S:
        raise InvalidInputError(
            f"{name}: {m} landmarks outnumber the tokens (L={L} queries, S={S} keys); expected "
            f"{name} <= min(L, S) = {min(L, S)}")


class _SameLength(attnkit.Limits):
    """L must equal S, except when one of them is 0 (empty in, empty or zeros out, as for any attention)."""

    def why_not(self, L: int, S: int) -> str | None:
        if L and S and L != S:
            return "L must equal S (the convolution residual adds V position by position)"
        return None


class NystromAttention(Float32Inside, attnkit.Attention):
    """Nystromformer attention: the softmax matrix approximated through ``m`` landmarks.

    Shapes as in :func:`torch.nn.functional.scaled_dot_product_attention`:
    q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.
    Non-causal only (landmarks average over the whole sequence); cross-attention
    (L != S) without the convolution. ``key_padding_mask`` is honoured: key
    landmarks are means of the real keys only and padded keys get no weight,
    so a padded key is absent, not zero (a row with no real key gives 0).
    Queries interact (the query landmarks mix them): a NaN query spreads.

    Args:
        num_heads: number of heads H (required with ``conv_kernel_size``).
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        num_landmarks: number of landmarks m, taken literally: more than L or S
            is an error. None (default): the paper's 64, or L for fewer queries
            (every query its own landmark; key landmarks repeat when there are
            fewer keys).
        pinv_iterations: iterations of the pseudo-inverse (the paper's 6).
        conv_kernel_size: odd kernel size of the depthwise-convolution residual
            on V (the paper's code uses 33), or None for none. Needs L == S
            (self-attention) and ``num_heads``.

    Raises:
        InvalidInputError: an option of the wrong type or out of range; at call
            time, more landmarks than queries or keys.
        UnsupportedFeatureError: causal, ``attn_mask``, other mask kinds; L != S
            with the convolution.
    """

    option_constraints = {"num_landmarks": {"minimum": 1}, "pinv_iterations": {"minimum": 0},
                          "conv_kernel_size": {"minimum": 1}}
    capabilities = NYSTROM.capabilities
    refusal_reasons = {
        "causal": "its landmarks are means over the whole sequence, so every output sees every key",
        "attn_mask": "a per-pair mask cannot be applied through landmarks; key_padding_mask is honoured",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", num_landmarks: int | None = None, pinv_iterations: int = 6,
                 conv_kernel_size: int | None = None) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.num_landmarks = check_int("num_landmarks", num_landmarks, allow_none=True)
        self.pinv_iterations = check_int("pinv_iterations", pinv_iterations, minimum=0)
        self.conv_kernel_size = check_int("conv_kernel_size", conv_kernel_size, allow_none=True)
        if conv_kernel_size is not None:
            if conv_kernel_size % 2 == 0:
                raise InvalidInputError(f"conv_kernel_size: expected an odd int (same-length convolution), "
                                        f"got {conv_kernel_size}")
            if num_heads is None:
                raise InvalidInputError("num_heads: the convolution residual has one kernel per head; give "
                                        "num_heads with conv_kernel_size")
            bound = 1 / math.sqrt(conv_kernel_size)   # nn.Conv2d's default init for fan_in = kernel size
            self.conv_weight = nn.Parameter(torch.empty(num_heads, conv_kernel_size).uniform_(-bound, bound))
        else:
            self.conv_weight = None

    @property
    def limits(self) -> attnkit.Limits:
        """L == S with the convolution; at least ``num_landmarks`` queries and keys when it is given (or none)."""
        base = attnkit.Limits() if self.conv_kernel_size is None else _SameLength(equal_length=True)
        m = self.num_landmarks or 1
        return shortest_lengths(base, min_queries=m, min_keys=m, reason=(
            f"num_landmarks {m}: {m} landmarks need at least {m} queries and {m} keys (num_landmarks=None: any "
            "length)"))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_landmarks={self.num_landmarks}, "
                f"pinv_iterations={self.pinv_iterations}, conv_kernel_size={self.conv_kernel_size}")

    def landmark_count(self, L: int, S: int) -> int:
        """m for L queries and S keys: ``num_landmarks`` (refused when it outnumbers them) or min(64, L).

        The default follows the query length only, so key padding never changes
        it (fewer real keys than m: key landmarks repeat, see ``segment_weights``).
        """
        if self.num_landmarks is None:
            return capped_count(L, DEFAULT_LANDMARKS)   # (an unbacked count for a dynamic L under torch.export)
        if transforms.symbolic(L, S):   # torch.export with a dynamic length: the program checks it (see limits)
            assert_at_least(L, self.num_landmarks, "nystrom: queries for num_landmarks")
            assert_at_least(S, self.num_landmarks, "nystrom: keys for num_landmarks")
        else:
            check_landmarks("num_landmarks", self.num_landmarks, L, S)
        return self.num_landmarks

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        L, S = q.shape[2], k.shape[2]
        m = self.landmark_count(L, S)
        keep = ctx.key_padding_mask
        scale = ctx.scale
        q_l = landmarks(q, None, m)
        k_l = landmarks(k, keep, m)
        k_ls = scale * k_l                              # the scale on the small (m, D) side
        a = torch.softmax(q_l @ k_ls.transpose(-1, -2), dim=-1)
        gv = keys_attend(scale * q_l, k, v, keep)                      # G V
        out = softmax_attend(q, k_ls.transpose(-1, -2), nystrom_pinv(a, self.pinv_iterations) @ gv)
        if self.conv_weight is not None:
            out = out + depthwise_conv(v, self.conv_weight)
        return out


def _key_chunks(k: Tensor, v: Tensor, keep: Tensor | None, cols: int):
    """(k, v, keep) chunks of ``cols`` keys along S."""
    keeps = keep.split(cols, dim=1) if keep is not None else [None] * -(-k.shape[2] // cols)
    return zip(k.split(cols, dim=2), v.split(cols, dim=2), keeps)


def _scores(q_l: Tensor, kc: Tensor, keepc: Tensor | None, scratch: Scratch) -> Tensor:
    """``q_l kcᵀ`` ``(B, H, m, cols)`` into ``scratch``, padded keys at the dtype's minimum."""
    batch = torch.broadcast_shapes(q_l.shape[:-2], kc.shape[:-2])
    s = torch.matmul(q_l, kc.transpose(-1, -2), out=scratch((*batch, q_l.shape[-2], kc.shape[-2])))
    if keepc is not None:
        s.masked_fill_(~keepc[:, None, None, :], torch.finfo(s.dtype).min)
    return s


def _block_scratch(q_l: Tensor, k: Tensor, cols: int) -> Scratch:
    """Scratch for one ``(B, H, m, cols)`` block, reused by every key chunk."""
    batch = torch.broadcast_shapes(q_l.shape[:-2], k.shape[:-2])
    return Scratch(math.prod(batch) * q_l.shape[-2] * min(cols, k.shape[-2]), q_l,
                   torch.promote_types(q_l.dtype, k.dtype))


def _keys_attend_streamed(q_l: Tensor, k: Tensor, v: Tensor, keep: Tensor | None,
                          cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """``softmax(q_l kᵀ) v`` over key chunks of ``cols`` with a running max and sum (online softmax), so the
    ``(m, S)`` score block is never allocated whole (a fresh 32 MiB per call at 16K, m = 64, H = 8).

    Returns ``(gv, row_max, 1 / row_sum)`` (the last two ``(B, H, m, 1)``, for the backward's
    recomputed weights ``exp(s - row_max) / row_sum``).
    """
    m_run = l_run = acc = None
    scratch = _block_scratch(q_l, k, cols)
    for kc, vc, keepc in _key_chunks(k, v, keep, cols):
        s = _scores(q_l, kc, keepc, scratch)
        m_new = s.amax(-1, keepdim=True)
        if m_run is not None:
            m_new = torch.maximum(m_run, m_new)
        s.sub_(m_new).exp_()
        if m_run is None:
            l_run, acc = s.sum(-1, keepdim=True), s @ vc
        else:
            alpha = (m_run - m_new).exp_()        # 0 when a real key follows only padded ones: their sums vanish
            l_run = l_run.mul_(alpha).add_(s.sum(-1, keepdim=True))
            acc = acc.mul_(alpha).add_(s @ vc)
        m_run = m_new
    inv = l_run.reciprocal_()
    return acc.mul_(inv), m_run, inv


class _KeysAttend(torch.autograd.Function):
    """``softmax(q_l kᵀ, padded keys at the dtype's minimum) v`` for few query rows ``q_l`` and all S keys.

    Forward: :func:`_keys_attend_streamed` (key chunks, online softmax), keeping only the row max and the
    inverse row sum. Backward, per key chunk (in cache): the weights ``P_c`` recomputed from the scores,
    ``dS_c = P_c ∘ (dGV V_cᵀ - rowsum(dGV ∘ GV))`` in place (``rowsum(P ∘ dP)`` read off the output),
    ``dq_l += dS_c K_c``, and ``dK_c = dS_cᵀ q_l``, ``dV_c = P_cᵀ dGV`` written straight into gradients laid
    out as ``k`` and ``v`` (:func:`~attnkit_lowrank.common.grad_like`). Autograd over the plain expression
    made five ``(m, S)`` tensors per call (32 MiB each at S = 16K, m = 64, H = 8, fresh pages every time) and
    per-head gradients that the head split then copied; recomputing the scores (one (m, D) x (D, S) product
    per head) costs less than writing and reading them back.
    """

    @staticmethod
    def forward(ctx, q_l: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, cols: int) -> Tensor:
        gv, m_run, inv = _keys_attend_streamed(q_l, k, v, keep, cols)
        ctx.save_for_backward(q_l, k, v, gv, m_run, inv)
        ctx.keep, ctx.cols = keep, cols
        return gv

    @staticmethod
    @first_order
    def backward(ctx, dgv: Tensor):
        q_l, k, v, gv, m_run, inv = ctx.saved_tensors
        keep, cols = ctx.keep, ctx.cols
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dgv = dgv.contiguous()
        r = (dgv * gv).sum(-1, keepdim=True)                            # rowsum(P ∘ dP)
        # masked_fill passes no gradient to the filled scores; P is exactly 0 there except in a row of only
        # padded keys (uniform weights), whose scores get none either
        dead = ~keep.any(-1) if keep is not None else None
        dead = dead if dead is not None and bool(dead.any()) else None
        batch = gv.shape[:-2]
        dk = grad_like(k, batch, gv.dtype) if need_k else None
        dv = grad_like(v, batch, gv.dtype) if need_v else None
        dq_l = None
        n = -(-k.shape[2] // cols)
        dks = dk.split(cols, dim=2) if need_k else [None] * n
        dvs = dv.split(cols, dim=2) if need_v else [None] * n
        scratch_p, scratch_s = _block_scratch(q_l, k, cols), _block_scratch(q_l, k, cols)
        for (kc, vc, keepc), dkc, dvc in zip(_key_chunks(k, v, keep, cols), dks, dvs):
            p = _scores(q_l, kc, keepc, scratch_p).sub_(m_run).exp_().mul_(inv)
            if need_v:
                torch.matmul(p.transpose(-1, -2), dgv, out=dvc)
            if not (need_q or need_k):
                continue
            ds = torch.matmul(dgv, vc.transpose(-1, -2), out=scratch_s(p.shape)).sub_(r).mul_(p)
            if dead is not None:
                ds[dead] = 0
            if need_q:
                dqc = ds @ kc
                dq_l = dqc if dq_l is None else dq_l.add_(dqc)
            if need_k:
                torch.matmul(ds.transpose(-1, -2), q_l, out=dkc)
        if dk is not None and dk.shape != k.shape:
            dk = dk.sum_to_size(k.shape)
        if dv is not None and dv.shape != v.shape:
            dv = dv.sum_to_size(v.shape)
        if dq_l is not None and dq_l.shape != q_l.shape:
            dq_l = dq_l.sum_to_size(q_l.shape)
        return dq_l, dk, dv, None, None


def keys_attend(q_l: Tensor, k: Tensor, v: Tensor, keep: Tensor | None) -> Tensor:
    """``softmax(q_l @ k^T) @ v`` (``q_l`` ``(B, H, m, D)`` already scaled), padded keys (``keep`` False) excluded;
    a row of only padded keys weighs them all equally, as ``masked_fill`` + ``softmax`` does (the caller
    zeroes such rows). Streamed over key chunks of ``chunk_rows(S, m)`` (online softmax); differentiable
    once, in q_l, k and v (:class:`_KeysAttend`)."""
    if transforms.plain_torch():   # torch.func / torch.export: plain torch ops (no out= products, no Function)
        s = q_l @ k.transpose(-1, -2)
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], torch.finfo(s.dtype).min)
        return torch.softmax(s, -1) @ v
    cols = chunk_rows(k.shape[2], q_l.shape[2])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q_l, k, v)):
        return _KeysAttend.apply(q_l, k, v, keep, cols)
    return _keys_attend_streamed(q_l, k, v, keep, cols)[0]


def depthwise_conv(v: Tensor, weight: Tensor) -> Tensor:
    """Per-head convolution of ``v`` ``(B, H, S, E)`` along S with ``weight`` ``(H, k)``, zero padded, same length."""
    H, ks = weight.shape
    return F.conv2d(v, weight.to(v.dtype).view(H, 1, ks, 1), padding=(ks // 2, 0), groups=H)
