"""``linformer``: :class:`LinformerAttention` (Wang et al. 2020), the torch path.

Keys and values are projected along the length by learned matrices
``E, F`` of shape ``(proj_len, max_length)`` (the first S columns for S keys,
which equals padding the sequence to ``max_length`` with zeros)::

    out = softmax(scale · Q (E K)^T) (F V)        O((L + S)·proj_len·D)

Options of the paper: one projection shared by all heads (``per_head=False``,
its "headwise sharing") or one per head, and ``E = F`` (``share_kv``, its
"key-value sharing"). A projection mixes every position, so there is no causal
form and no key padding (a padded key would still occupy its column of E).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import attnkit
from attnkit import InvalidInputError
from attnkit.transforms import symbolic

from ..common import Float32Inside, check_bool, check_int, softmax_attend
from ..plugin import LINFORMER


class LinformerAttention(Float32Inside, attnkit.Attention):
    """Linformer attention: softmax over ``proj_len`` learned projections of the keys.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` ->
    ``(B, H, L, E)``; S up to ``max_length`` (cross-attention allowed: the
    projections run along the keys).

    Args:
        num_heads: number of heads H (required with ``per_head=True``).
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` or ``"torch"``.
        proj_len: projected length k (the paper's 256).
        max_length: the longest key sequence n; the projections are
            ``(proj_len, max_length)`` parameters, and longer sequences are refused.
        share_kv: use one projection for keys and values (E = F).
        per_head: one projection per head instead of one shared by all heads.

    Raises:
        InvalidInputError: an option of the wrong type or out of range.
        UnsupportedFeatureError: causal (listing the implementations that have a
            causal form), any mask, L or S beyond ``max_length``.
    """

    option_constraints = {"proj_len": {"minimum": 1}, "max_length": {"minimum": 1}}
    capabilities = LINFORMER.capabilities
    refusal_reasons = {
        "causal": ("Linformer has no causal form: its projections E and F mix every position of the sequence "
                   "into each projected key, so every output would see future keys"),
        "key_padding_mask": ("Linformer's projections give every position of the sequence its own column, so a "
                             "padded key cannot be made absent"),
        "attn_mask": "a per-pair mask cannot be applied to projected keys",
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto", proj_len: int = 256, max_length: int = 4096, share_kv: bool = False,
                 per_head: bool = False) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.proj_len = check_int("proj_len", proj_len)
        self.max_length = check_int("max_length", max_length)
        self.share_kv = check_bool("share_kv", share_kv)
        self.per_head = check_bool("per_head", per_head)
        if per_head and num_heads is None:
            raise InvalidInputError("num_heads: per_head=True keeps one projection per head; give num_heads")
        p = num_heads if per_head else 1
        std = proj_len ** -0.5                      # N(0, 1/k), the paper's Johnson-Lindenstrauss scaling
        self.proj_k = nn.Parameter(torch.randn(p, proj_len, max_length) * std)
        self.proj_v = None if share_kv else nn.Parameter(torch.randn(p, proj_len, max_length) * std)

    @property
    def limits(self) -> attnkit.Limits:
        return attnkit.Limits(max_length=self.max_length)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, proj_len={self.proj_len}, max_length={self.max_length}, "
                f"share_kv={self.share_kv}, per_head={self.per_head}")

    def projections(self, S: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``E, F`` restricted to S keys: ``(1 or H, proj_len, S)`` each, in ``dtype``."""
        def cut(w: Tensor) -> Tensor:
            # all S = max_length columns: the parameter itself (a slice's backward zero-fills a whole
            # parameter-sized gradient and copies into it: 2 x 16 MiB per call at 16K, proj_len 256); a length
            # torch.export traces as dynamic is always sliced (a branch on it would fix the length)
            if symbolic(S):
                # a gather, not a slice: a slice's layout (contiguous iff S == max_length) is a guard on S
                return w.to(dtype).index_select(-1, torch.arange(S, device=w.device))
            return (w if S == w.shape[-1] else w[:, :, :S]).to(dtype)
        e = cut(self.proj_k)
        f = e if self.proj_v is None else cut(self.proj_v)
        return e, f

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx) -> Tensor:
        e, f = self.projections(k.shape[2], q.dtype)
        k_p = project(e, k)                                           # (B, H, proj_len, D)
        v_p = k_p if self.proj_v is None and v is k else project(f, v)
        return softmax_attend(q, (ctx.scale * k_p).transpose(-1, -2), v_p)


def project(e: Tensor, x: Tensor) -> Tensor:
    """``e @ x`` for ``e`` ``(1 or H, k, S)`` and ``x`` ``(B, H, S, D)`` -> ``(B, H, k, D)``.

    A projection shared by the heads is one ``(k, S) x (S, B·H·D)`` product
    (broadcasting it over B and H would copy it B·H times).
    """
    B, H, S, D = x.shape
    if e.shape[0] != 1:
        return e @ x
    # e.reshape, not e[0]: a select's backward zero-fills a (1, k, max_length) gradient and copies into it
    y = e.reshape(e.shape[1:]) @ x.permute(2, 0, 1, 3).reshape(S, B * H * D)
    return y.view(-1, B, H, D).permute(1, 2, 0, 3)
