"""``memory-compressed`` (alias ``mca``): :class:`MemoryCompressedAttention` (Liu et al. 2018), the torch path.

Keys and values are shortened by a strided convolution (kernel = stride,
the paper's 3) before ordinary softmax attention: ``S`` keys become
``ceil(S / stride)`` compressed keys, cost O(L·S/stride·D). The last window
may be short (zero filled). ``compression="pool"`` averages each window instead.

Causal form: a compressed key summarises positions ``[j·s, (j+1)·s)``, so
query ``i`` sees compressed key ``j`` only when the whole window is in its
past, ``min((j+1)·s, S) - 1 <= i``. The first ``stride - 1`` queries see no
compressed key and give 0 (the paper pairs this layer with local attention,
which covers them).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

import attnkit
from attnkit import InvalidInputError

from ..common import (
    Float32Inside,
    assert_at_least,
    check_choice,
    check_int,
    shortest_lengths,
    softmax_attend,
    window_counts,
    windows,
)
from ..plugin import MCA

COMPRESSIONS = ("conv", "pool")


def compress(x: Tensor, stride: int, weight: Tensor | None) -> Tensor:
    """``ceil(S / stride)`` windows of ``x`` ``(B, H, S, C)``: ``weight`` ``(C, C, stride)`` conv, or mean."""
    B, H, S, C = x.shape
    xp = windows(x, stride)                                                # (B, H, m, stride, C)
    m = xp.shape[2]
    if weight is None:
        return xp.sum(3) / window_counts(S, m, stride, x)
    w = weight.to(x.dtype).permute(2, 1, 0).reshape(stride * C, C)        # [t·C + c_in, c_out]
    return xp.reshape(B, H, m, stride * C) @ w


def visible(L: int, S: int, m: int, stride: int, device: torch.device) -> Tensor:
    """bool ``(L, m)``: query i sees compressed key j iff its window ends at or before i (causal form)."""
    last = torch.clamp(torch.arange(1, m + 1, device=device) * stride, max=S) - 1
    return last[None, :] <= torch.arange(L, device=device)[:, None]


class MemoryCompressedAttention(Float32Inside, attnkit.Attention):
    """Memory-compressed attention: softmax attention over strided-convolution summaries of the keys and values.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` ->
    ``(B, H, L, E)``. Non-causal (also cross-attention) and causal (L == S).

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D (required with ``compression="conv"``).
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        stride: compression factor (kernel = stride; the paper's 3); must not
            exceed S (a limit of the instance: :attr:`limits`).
        compression: ``"conv"`` (learned strided convolutions of keys and of
            values, no bias, the paper's) or ``"pool"`` (window means).
        value_dim: value dimension E of the value convolution (None: head_dim).

    Raises:
        InvalidInputError: an option of the wrong type or out of range; at call
            time values of another E.
        UnsupportedFeatureError: key padding, ``attn_mask``, causal with L != S,
            fewer than ``stride`` keys (S > 0).
    """

    option_constraints = {"stride": {"minimum": 1}, "compression": {"choices": COMPRESSIONS},
                          "value_dim": {"minimum": 1}}
    capabilities = MCA.capabilities
    refusal_reasons = {
        "key_padding_mask": "a compressed key mixes `stride` neighbouring keys, so a padded key cannot be absent",
        "attn_mask": "a per-pair mask does not apply to compressed keys",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", stride: int = 3, compression: str = "conv",
                 value_dim: int | None = None) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.stride = check_int("stride", stride)
        self.compression = check_choice("compression", compression, COMPRESSIONS)
        self.value_dim = check_int("value_dim", value_dim, allow_none=True)
        if compression == "conv":
            if head_dim is None:
                raise InvalidInputError("head_dim: the strided convolution maps head_dim channels; give head_dim "
                                        "with compression='conv' (or use compression='pool')")
            e = value_dim or head_dim
            self.conv_k = nn.Parameter(torch.empty(head_dim, head_dim, stride).uniform_(-1, 1)
                                       / math.sqrt(head_dim * stride))
            self.conv_v = nn.Parameter(torch.empty(e, e, stride).uniform_(-1, 1) / math.sqrt(e * stride))
        else:
            self.conv_k = self.conv_v = None

    @property
    def limits(self) -> attnkit.Limits:
        """A compression window must fit in the keys: ``S >= stride`` (or S = 0)."""
        return shortest_lengths(super().limits, min_keys=self.stride, reason=(
            f"stride {self.stride}: a compression window of {self.stride} positions needs at least {self.stride} "
            "keys"))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, stride={self.stride}, compression={self.compression!r}"

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        L, S = q.shape[2], k.shape[2]
        assert_at_least(S, self.stride, "memory-compressed: the keys of a compression window")   # (see limits)
        if self.conv_v is not None and v.shape[-1] != self.conv_v.shape[0]:
            raise InvalidInputError(f"v: the value convolution was built for E={self.conv_v.shape[0]} "
                                    f"(value_dim), got v {tuple(v.shape)}")
        k_c = compress(k, self.stride, self.conv_k)
        v_c = compress(v, self.stride, self.conv_v)
        if not ctx.causal:
            return softmax_attend(q, (ctx.scale * k_c).transpose(-1, -2), v_c)
        s = q @ (ctx.scale * k_c).transpose(-1, -2)                      # (B, H, L, m)
        keep = visible(L, S, k_c.shape[2], self.stride, q.device)
        s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
        w = torch.softmax(s, -1) * keep                                    # rows with no visible key: 0
        return w @ v_c
