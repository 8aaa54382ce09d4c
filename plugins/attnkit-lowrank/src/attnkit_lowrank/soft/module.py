"""``soft``: :class:`SoftAttention` (SOFT, Lu et al. 2021), the torch path.

Softmax-free self-attention: the attention matrix is the Gaussian kernel
``S_ij = exp(-scale/2 · |q_i - k_j|^2)`` (the paper's ``exp(-|q - k|^2 / (2 sqrt(d)))``
at the default ``scale = 1/sqrt(d)``), with no normalisation; the paper shares
one projection for queries and keys (Q = K), which makes S symmetric, positive
semi-definite, with ones on the diagonal. It is never formed: with ``m``
bottleneck tokens ``K~`` (a strided convolution, kernel = stride, or an average
pool of the keys),

    P_q = gauss(Q, K~) (L, m),  A = gauss(K~, K~) (m, m),  P_k = gauss(K, K~) (S, m)
    out = P_q (A^+ (P_k^T V))

with ``A^+`` from the Newton-Raphson iteration ``V <- 2V - V A V``
(:func:`attnkit_lowrank.common.newton_pinv`; on CPU the same iterate from one
eigendecomposition of the symmetric ``A``, :func:`~attnkit_lowrank.common.newton_pinv_sym`).
Passing the same tensor as q and k is the paper's form (``P A^+ P^T``); distinct q and k give the same
Nystrom factorisation of the kernel between them. Cost O(L·m·D + m^3·iterations)
with ``m = ceil(L / stride)``: linear in L for a fixed number of bottleneck
tokens, i.e. a stride that grows with L (the paper fixes m per stage).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit
from attnkit import InvalidInputError
from attnkit.transforms import symbolic

from ..common import (
    Float32Inside,
    assert_at_least,
    check_choice,
    check_int,
    newton_pinv,
    newton_pinv_sym,
    shortest_lengths,
    window_counts,
    windows,
)
from ..plugin import SOFT
from .chunk import soft_kernel_product

BOTTLENECKS = ("conv", "pool")
DEFAULT_STRIDE = 64


def gaussian_kernel(x: Tensor, y: Tensor, scale: float) -> Tensor:
    """``exp(-scale/2 · |x_i - y_j|^2)`` for ``x`` ``(..., n, D)``, ``y`` ``(..., m, D)`` -> ``(..., n, m)``.

    One matrix product and one ``exp``: the exponent
    ``scale·x·y - scale/2·|x|^2 - scale/2·|y|^2`` is the product of
    ``[scale·x, -scale/2·|x|^2, 1]`` and ``[y, 1, -scale/2·|y|^2]``, so no
    ``(n, m)`` temporaries beyond the result.
    """
    hx = (-0.5 * scale) * (x * x).sum(-1, keepdim=True)
    hy = (-0.5 * scale) * (y * y).sum(-1, keepdim=True)
    xa = torch.cat([scale * x, hx, torch.ones_like(hx)], -1)
    ya = torch.cat([y, torch.ones_like(hy), hy], -1)
    # exp in place: the product's backward needs only its inputs, and a second (n, m) tensor would cost
    # its allocation (page faults: ~50 ms for 8 x 16K x 256 floats, as long as the exp itself)
    return (xa @ ya.transpose(-1, -2)).exp_()


class SoftAttention(Float32Inside, attnkit.Attention):
    """SOFT: softmax-free Gaussian-kernel attention through bottleneck tokens, linear in L for a fixed m.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, E)`` ->
    ``(B, H, L, E)``: self-attention only (L == S; the paper's Q = K).

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D (required with ``bottleneck="conv"``: the
            convolution maps D channels to D, shared by the heads).
        scale: the kernel is ``exp(-scale/2 · |q - k|^2)``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        stride: bottleneck window: each bottleneck token summarises ``stride``
            consecutive keys (the last window may be shorter), so
            ``m = ceil(L / stride)``; taken literally, a stride longer than L is
            refused (a limit of the instance: :attr:`limits`). None (default):
            64 (the paper reduces 3136 tokens to 49, a factor of 64), and a
            shorter sequence is one zero-filled window.
        bottleneck: ``"conv"`` (a learned strided convolution, kernel = stride,
            no bias; the paper's better choice) or ``"pool"`` (average pooling).
        pinv_iterations: Newton-Raphson iterations of the Moore-Penrose inverse
            (the paper's 20).

    Raises:
        InvalidInputError: an option of the wrong type or out of range.
        UnsupportedFeatureError: L != S, causal, any mask, a sequence shorter
            than an explicit ``stride`` (L > 0).
    """

    option_constraints = {"stride": {"minimum": 1}, "bottleneck": {"choices": BOTTLENECKS},
                          "pinv_iterations": {"minimum": 0}}
    capabilities = SOFT.capabilities
    refusal_reasons = {
        "cross": ("SOFT's attention is the Gaussian kernel of one sequence with itself (queries and keys share a "
                  "projection, Q = K): it needs L == S"),
        "causal": "its bottleneck tokens summarise the whole sequence, so every output sees every key",
        "key_padding_mask": "its bottleneck windows are fixed runs of positions, so a padded key cannot be absent",
        "attn_mask": "a per-pair mask cannot be applied through bottleneck tokens",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", stride: int | None = None, bottleneck: str = "conv",
                 pinv_iterations: int = 20) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.stride = check_int("stride", stride, allow_none=True)
        self.window = DEFAULT_STRIDE if stride is None else stride
        self.bottleneck = check_choice("bottleneck", bottleneck, BOTTLENECKS)
        self.pinv_iterations = check_int("pinv_iterations", pinv_iterations, minimum=0)
        if bottleneck == "conv":
            if head_dim is None:
                raise InvalidInputError("head_dim: the strided convolution maps head_dim channels; give head_dim "
                                        "with bottleneck='conv' (or use bottleneck='pool')")
            bound = 1 / math.sqrt(head_dim * self.window)     # nn.Conv1d's default init
            self.conv_weight = nn.Parameter(torch.empty(head_dim, head_dim, self.window).uniform_(-bound, bound))
        else:
            self.conv_weight = None

    @property
    def limits(self) -> attnkit.Limits:
        """An explicit stride must fit in the sequence: ``L = S >= stride`` (or 0); the default any length."""
        s = self.stride or 1
        return shortest_lengths(super().limits, min_queries=s, min_keys=s, reason=(
            f"stride {s}: a bottleneck window of {s} positions needs at least {s} keys (stride=None: any length)"))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, stride={self.stride}, bottleneck={self.bottleneck!r}, "
                f"pinv_iterations={self.pinv_iterations}")

    def bottleneck_tokens(self, k: Tensor) -> Tensor:
        """``ceil(S / stride)`` bottleneck tokens of ``k`` ``(B, H, S, D)`` -> ``(B, H, m, D)``."""
        B, H, S, D = k.shape
        s = self.window
        if symbolic(S):
            # a dynamic length under torch.export: m from chunk_count, the windows always padded (a branch on
            # S % s would fix the length); the same tokens as below
            x = windows(k, s)                                                    # (B, H, m, s, D)
            m = x.shape[2]
            if self.conv_weight is None:
                return x.sum(3) / window_counts(S, m, s, k)
            return x.reshape(B, H, m, s * D) @ self.conv_weight.to(k.dtype).permute(2, 1, 0).reshape(s * D, D)
        m = -(-S // s)
        if self.conv_weight is None:
            if S % s == 0:
                return k.unflatten(2, (m, s)).mean(3)
            x = F.pad(k, (0, 0, 0, m * s - S)).unflatten(2, (m, s)).sum(3)
            counts = torch.full((m,), float(s), dtype=k.dtype, device=k.device)
            counts[-1] = S - (m - 1) * s
            return x / counts[:, None]
        # strided convolution, kernel = stride: one (m, s·D) x (s·D, D) product (no padding copy when s divides S)
        x = (k if m * s == S else F.pad(k, (0, 0, 0, m * s - S))).reshape(B, H, m, s * D)
        w = self.conv_weight.to(k.dtype).permute(2, 1, 0).reshape(s * D, D)      # [t·D + c_in, c_out]
        return x @ w

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        if self.stride is not None:
            assert_at_least(k.shape[2], self.stride, "soft: the keys of a bottleneck window")   # (see limits)
        scale = ctx.scale
        k_b = self.bottleneck_tokens(k)
        a = gaussian_kernel(k_b, k_b, scale)
        on_cpu = a.device.type == "cpu"
        # A is symmetric (the kernel of K~ with itself), so on CPU the Newton iterate comes from one float64
        # eigendecomposition (newton_pinv_sym: the same function, more accurate in float32, and 2·iterations
        # fewer m x m products forward and backward; where every eigenvalue has converged, certified per call, the
        # inverse from A's Cholesky factor instead). On other devices the products are cheap: plain Newton.
        # (A one-product-per-iteration polynomial form, T <- 2T - T^2, x <- 2x - T x, was tried: 30-130x the
        # float32 error at cond(A) 7e2-9e3.)
        z = (newton_pinv_sym if on_cpu else newton_pinv)(a, self.pinv_iterations)
        if on_cpu:
            # the (L, m) kernels made and used in cache chunk by chunk, with their own backward (chunk.py)
            return soft_kernel_product(q, k, k_b, z, v, scale)
        p_k = gaussian_kernel(k, k_b, scale)
        p_q = p_k if q is k else gaussian_kernel(q, k_b, scale)
        return p_q @ (z @ (p_k.transpose(-1, -2) @ v))
