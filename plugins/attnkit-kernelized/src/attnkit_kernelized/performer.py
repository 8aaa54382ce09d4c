"""``performer``: FAVOR+ random-feature softmax attention (Choromanski et al. 2021).

``exp(q . k · scale)`` is estimated by ``phi(q) . phi(k)`` with positive
orthogonal random features ``phi(x) = exp(W x - |x|^2/2) / sqrt(M)`` of
``x = sqrt(scale) · q``; attention then costs O(L·M·E) instead of O(L·S·D).

Numerical stabilisation (the features are exponentials):

* queries: the row maximum of ``W x`` is subtracted in the exponent; it is a
  per-query constant, so it cancels between numerator and denominator.
* keys, non-causal: the maximum of ``W y - |y|^2/2`` over all real (not
  padded) keys and features of a (batch, head) is subtracted (a constant for
  every key a query sees, so it cancels too), as in the reference code.
* keys, causal and streaming: no data-dependent shift, because a maximum over
  the sequence would let future keys change past outputs (and break exact
  streaming). The key exponent is bounded above by ``|w_i|^2/2`` (complete
  the square), which stays far from float32 overflow for head dims up to
  ~128; keys with ``scale·|k|^2`` beyond ~170 underflow to 0 in float32.

The random projection lives in the ``features`` buffer (state_dict, ``.to()``),
drawn from ``seed`` (or torch's global RNG when ``seed`` is None), and can be
redrawn on demand (:meth:`PerformerAttention.redraw_features`) or every
``redraw_interval`` training-mode forward calls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.errors import InvalidInputError

from ._base import KernelizedAttention, check_choice, check_int
from .feature_maps import draw_gaussian_features
from .plugin import PERFORMER

FEATURE_MAPS = ("positive", "trig", "generalized")
#: added to the generalized (relu) kernel's features, as in the reference code
GENERALIZED_EPS = 1e-3


class PerformerAttention(KernelizedAttention):
    """Performer (FAVOR+) attention: an unbiased random-feature estimate of softmax attention.

    Shapes as in :func:`torch.nn.functional.scaled_dot_product_attention`:
    q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.
    Non-causal (also cross-attention, L != S) and causal (L == S, a prefix
    sum: numba kernel on CPU, triton on CUDA, chunked torch form otherwise).
    Key padding zeroes the features of padded keys; a query that sees no key
    gives 0. ``attn_mask`` is refused (it cannot be expressed in the kernel form).

    Args:
        num_heads: number of heads H (used to size the streaming state).
        head_dim: head dimension D the random features are drawn for (required).
        scale: multiplier of ``q·k`` in the softmax being estimated; None means
            ``1/sqrt(D)``.
        backend: ``"auto"`` (numba for causal CPU tensors, triton for causal
            CUDA tensors, else torch), or one of ``"torch"``, ``"numba"``, ``"triton"``.
        num_features: number of random features M (>= 1); more features, less
            error (about ``1/sqrt(M)``). The ``"trig"`` map uses 2·M features
            (a sine and a cosine per projection).
        feature_map: ``"positive"`` (FAVOR+ positive random features, the
            paper's), ``"trig"`` (the v1 sin/cos map, unbiased but not
            positive, so its denominator can vanish) or ``"generalized"``
            (``relu(W x) + 0.001``, the generalized-attention kernel; not a
            softmax estimate).
        orthogonal: draw rows orthogonal in blocks of D (ORF, lower variance)
            instead of i.i.d. Gaussian.
        redraw_interval: in training mode, redraw the features every this many
            forward calls (None: only on :meth:`redraw_features`).
        seed: features are drawn from ``torch.Generator().manual_seed(seed + n)``
            for the n-th draw, independent of the global RNG; None draws from
            torch's global RNG (reproducible under ``torch.manual_seed``).
        chunk_size: positions per chunk of the torch causal form.

    Raises:
        InvalidInputError: ``num_features`` < 1, ``head_dim`` missing, or
            another option out of range (named in the message).
    """

    capabilities = PERFORMER.capabilities  # as registered; used when built without the registry

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", num_features: int = 256,
                 feature_map: str = "positive", orthogonal: bool = True,
                 redraw_interval: int | None = None, seed: int | None = None,
                 chunk_size: int = 64) -> None:
        check_int("num_features", num_features)
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend,
                         chunk_size=chunk_size)
        self.num_random = num_features
        self.feature_map = check_choice("feature_map", feature_map, FEATURE_MAPS)
        if not isinstance(orthogonal, bool):
            raise InvalidInputError(f"orthogonal: expected a bool, got {orthogonal!r}")
        self.orthogonal = orthogonal
        self.redraw_interval = check_int("redraw_interval", redraw_interval, allow_none=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidInputError(f"seed: expected an int or None, got {seed!r}")
        self.seed = seed
        self.register_buffer("features", torch.empty(num_features, head_dim))
        self.register_buffer("num_draws", torch.zeros((), dtype=torch.long))
        self.register_buffer("calls_since_draw", torch.zeros((), dtype=torch.long))
        self.redraw_features()

    # ------------------------------------------------------------ features
    @property
    def feature_dim(self) -> int:
        """M features per head: ``num_features``, or twice that for ``"trig"``."""
        return 2 * self.num_random if self.feature_map == "trig" else self.num_random

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_features={self.num_random}, feature_map={self.feature_map!r}, "
                f"orthogonal={self.orthogonal}")

    @torch.no_grad()
    def redraw_features(self, seed: int | None = None) -> None:
        """Draw a new random projection into the ``features`` buffer.

        Args:
            seed: draw from ``torch.Generator().manual_seed(seed)``; None uses
                the module's ``seed`` (``seed + number of earlier draws``) or,
                when that is None too, torch's global RNG.
        """
        if seed is None and self.seed is not None:
            seed = self.seed + int(self.num_draws)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        w = draw_gaussian_features(self.num_random, self.head_dim, orthogonal=self.orthogonal, generator=gen,
                                   dtype=torch.float64)
        self.features.copy_(w.to(self.features.dtype))
        self.num_draws += 1
        self.calls_since_draw.zero_()

    def _maybe_redraw(self) -> None:
        if self.training and self.redraw_interval is not None:
            if int(self.calls_since_draw) >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_draw += 1

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q) (B, H, L, M), phi(k) (B, H, S, M))``, stabilised as the module docstring says.

        Padded keys are left out of the non-causal key stabiliser.
        """
        s = self.get_scale(q) ** 0.5
        if self.feature_map == "generalized":
            w = self.features.to(q.dtype).transpose(0, 1)
            return F.relu((q * s) @ w) + GENERALIZED_EPS, F.relu((k * s) @ w) + GENERALIZED_EPS
        if self.feature_map == "trig":
            w = self.features.to(q.dtype).transpose(0, 1)
            x, y = q * s, k * s
            return self._trig(x, w), self._trig_keys(y, w, causal, key_padding_mask)
        # positive features. sqrt(scale) is folded into W, and the in-place ops on the fresh matmul
        # outputs keep the big (B, H, L, M) allocations to one per side.
        w = (self.features.to(q.dtype) * s).transpose(0, 1)           # (D, M)
        lq = q @ w
        lq = lq.sub_(lq.detach().amax(-1, keepdim=True)).exp_()       # per-query shift cancels
        half_sq = torch.linalg.vector_norm(k, dim=-1, keepdim=True).square() * (0.5 * s * s)
        lk = (k @ w).sub_(half_sq + 0.5 * math.log(self.num_random))  # W y - |y|^2/2 - log(M)/2
        if not causal:
            lk = lk.sub_(self._key_max(lk.detach(), key_padding_mask))
        return lq, lk.exp_()

    @staticmethod
    def _key_max(lk: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """Max over real keys and features per (batch, head), ``(B, H, 1, 1)``; 0 when all are padded."""
        if key_padding_mask is not None:
            lk = lk.masked_fill(~key_padding_mask[:, None, :, None], float("-inf"))
        m = lk.amax(dim=(-2, -1), keepdim=True)
        return torch.where(torch.isfinite(m), m, torch.zeros_like(m))

    def _trig(self, x: Tensor, w: Tensor) -> Tensor:
        # the exp(|x|^2/2) factor of a query is a per-row constant: it cancels
        p = x @ w
        return torch.cat([torch.sin(p), torch.cos(p)], dim=-1)

    def _trig_keys(self, y: Tensor, w: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        log_norm = 0.5 * (y * y).sum(-1, keepdim=True)
        if not causal:
            log_norm = log_norm - self._key_max(log_norm.detach(), key_padding_mask)
        return self._trig(y, w) * torch.exp(log_norm)

    # ------------------------------------------------------------ forward
    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        self._maybe_redraw()
        return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
