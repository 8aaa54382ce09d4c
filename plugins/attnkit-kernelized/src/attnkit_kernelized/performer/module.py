"""``performer``: :class:`PerformerAttention` (FAVOR+), its options, features and stabilisers.

``exp(q . k · scale)`` is estimated by ``phi(q) . phi(k)`` with positive
orthogonal random features ``phi(x) = exp(W x - |x|^2/2) / sqrt(M)`` of
``x = sqrt(scale) · q``; attention is then linear attention on these features
(the ``linear`` backends), O(L·M·E) instead of O(L·S·D).

Numerical stabilisation (the features are exponentials; every shift is a
constant that cancels between numerator and denominator):

* queries: the maximum of each query's own exponents (per row: a NaN or Inf
  query changes its own row only).
* keys, non-causal: the maximum over the real (not padded) keys and features
  of a (batch, head), as in the reference code; padded keys never enter it.
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

import torch
from torch import Tensor

from ..base import KernelizedAttention
from ..common import padded, zero_padded
from ..feature_maps import draw_gaussian_features, favor_generalized, favor_positive, favor_trig
from ..options import check_bool, check_choice, check_int, check_seed
from ..plugin import PERFORMER

FEATURE_MAPS = ("positive", "trig", "generalized")


class PerformerAttention(KernelizedAttention):
    """Performer (FAVOR+) attention: an unbiased random-feature estimate of softmax attention.

    Shapes as in :func:`torch.nn.functional.scaled_dot_product_attention`:
    q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.
    Non-causal (also cross-attention, L != S) and causal (L == S, a prefix
    sum), each on every backend (``torch``, ``numba`` on CPU, ``triton`` on
    CUDA). Padded keys add nothing; a query that sees no key gives 0.
    ``attn_mask`` is refused (it cannot be expressed in the kernel form).

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D the random features are drawn for (required).
        scale: multiplier of ``q·k`` in the softmax being estimated; None means
            ``1/sqrt(D)``.
        backend: ``"auto"`` (triton for CUDA tensors, numba for CPU tensors), or
            one of ``"torch"``, ``"numba"``, ``"triton"`` (always that backend, or an error).
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
        chunk_size: positions per chunk of the causal forms.

    Raises:
        InvalidInputError: an option of the wrong type or out of range (named in the message).
    """

    #: ranges and choices checked by attnkit.build before the module is built (the constructor checks again)
    option_constraints = {"num_features": {"minimum": 1}, "feature_map": {"choices": FEATURE_MAPS},
                          "redraw_interval": {"minimum": 1}, "seed": {"minimum": 0}}

    capabilities = PERFORMER.capabilities  # the spec's one declaration; used when built without the registry

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
        self.orthogonal = check_bool("orthogonal", orthogonal)
        self.redraw_interval = check_int("redraw_interval", redraw_interval, allow_none=True)
        self.seed = check_seed("seed", seed)
        self.register_buffer("features", torch.empty(num_features, head_dim))
        self.register_buffer("num_draws", torch.zeros((), dtype=torch.long))
        self.register_buffer("calls_since_draw", torch.zeros((), dtype=torch.long))
        self.redraw_features()

    def feature_count(self, head_dim: int) -> int:
        """M features per head: ``num_features``, or twice that for ``"trig"``."""
        return 2 * self.num_random if self.feature_map == "trig" else self.num_random

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_features={self.num_random}, feature_map={self.feature_map!r}, "
                f"orthogonal={self.orthogonal}")

    # ------------------------------------------------------------ features
    @torch.no_grad()
    def redraw_features(self, seed: int | None = None) -> None:
        """Draw a new random projection into the ``features`` buffer.

        Args:
            seed: draw from ``torch.Generator().manual_seed(seed)``; None uses
                the module's ``seed`` (``seed + number of earlier draws``) or,
                when that is None too, torch's global RNG.

        Raises:
            InvalidInputError: ``seed`` not an int >= 0 or None.
        """
        seed = check_seed("seed", seed)
        if seed is None and self.seed is not None:
            seed = self.seed + int(self.num_draws)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        w = draw_gaussian_features(self.num_random, self.head_dim, orthogonal=self.orthogonal, generator=gen,
                                   dtype=torch.float64)
        self.features.copy_(w.to(self.features.dtype))
        self.num_draws += 1
        self.calls_since_draw.zero_()

    def _before_forward(self) -> None:
        if self.training and self.redraw_interval is not None:
            if int(self.calls_since_draw) >= self.redraw_interval:
                self.redraw_features()
            self.calls_since_draw += 1

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q) (B, H, L, M), phi(k) (B, H, S, M))``, stabilised as the module docstring says; 0 at padded keys."""
        s = self.get_scale(q) ** 0.5                      # features of sqrt(scale)·q, sqrt(scale)·k
        w = self.features.to(q.dtype)
        pad = padded(key_padding_mask)
        keys = None if causal else "keys"
        keep = None if pad is None else ~pad
        if self.feature_map == "generalized":
            phi_q, phi_k = favor_generalized(q, w, scale=s), favor_generalized(k, w, scale=s)
        elif self.feature_map == "trig":  # a query's exp(|x|^2/2) is a per-row constant: it cancels
            phi_q = favor_trig(q, w, scale=s, drop_norm=True)
            phi_k = favor_trig(k, w, scale=s, stabilize=keys, keep=keep)
        else:
            phi_q = favor_positive(q, w, scale=s, stabilize="row")
            phi_k = favor_positive(k, w, scale=s, stabilize=keys, keep=keep)
        return phi_q, zero_padded(phi_k, pad)
