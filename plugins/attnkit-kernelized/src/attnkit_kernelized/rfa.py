"""``rfa``: random feature attention with a learned gate (Peng et al. 2021).

Queries and keys are l2-normalised and mapped by random Fourier features
``phi(x) = sqrt(1/M) [sin(W x / sigma), cos(W x / sigma)]``, whose inner
product estimates the Gaussian kernel ``exp(-|x - y|^2 / (2 sigma^2))``,
which for unit vectors is proportional to ``exp(x . y / sigma^2)``: a softmax
with temperature ``sigma^2`` over cosine similarities. ``sigma`` is learned
per head (``learn_sigma``).

Causal RFA is gated (the paper's eq. 7)::

    S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T
    z_t = g_t z_{t-1} + (1 - g_t) phi(k_t)
    out_t = phi(q_t)^T S_t / phi(q_t) . z_t

with a scalar gate per position and head, ``g_t = sigmoid(w_h . k_t + b_h)``.
The paper computes the gate from the layer input ``x_t``; an attention module
here sees only the per-head keys, which are a linear function of ``x_t``, so
the gate is a learned projection of ``k_t``. Padded keys neither write nor
decay the state (``g_t = 1`` there). The non-causal form (and
cross-attention) is ungated RFA, as in the paper.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.errors import InvalidInputError

from . import chunked
from ._base import KernelizedAttention, check_choice, check_int, key_mask, normalize
from .feature_maps import draw_gaussian_features
from .plugin import RFA

FEATURE_MAPS = ("trig", "positive")


class RandomFeatureAttention(KernelizedAttention):
    """RFA: random-feature attention, gated in its causal form.

    Shapes as in :func:`torch.nn.functional.scaled_dot_product_attention`:
    q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.
    Causal (L == S): the gated recurrence, computed by the numba kernel on CPU
    tensors (per-position recurrence, checkpointed backward) or the chunked
    torch form, and streamed exactly through ``init_state``/``step``. Non-causal (also
    L != S): ungated RFA. ``attn_mask`` is refused.

    Args:
        num_heads: number of heads H (the gate and sigma are per head; required).
        head_dim: head dimension D the random features and gate are drawn for (required).
        scale: None (default) starts sigma at ``sigma``; a float starts it at
            ``scale ** -0.5`` (the kernel is then ``exp(scale · cos-sim)`` up to a constant).
        backend: ``"auto"`` (numba for causal CPU tensors, else torch), ``"torch"`` or ``"numba"``.
        num_features: number of random frequencies M (>= 1); ``"trig"`` gives
            2·M features (sin and cos).
        feature_map: ``"trig"`` (random Fourier features, the paper's; not
            positive, so the denominator can vanish) or ``"positive"`` (FAVOR+
            positive features of the normalised inputs, always > 0).
        sigma: initial kernel width sigma (> 0).
        learn_sigma: learn ``log sigma`` per head (True) or keep it fixed.
        gate: use the learned gate in the causal form (False: ungated causal RFA,
            ``S_t = S_{t-1} + phi(k_t) v_t^T``).
        gate_init: initial gate value g in (0, 1) (bias ``logit(g)``, weights 0).
        orthogonal: draw the random frequencies orthogonal in blocks of D.
        seed: draw the frequencies from ``torch.Generator().manual_seed(seed)``;
            None uses torch's global RNG.
        chunk_size: positions per chunk of the causal form.

    Raises:
        InvalidInputError: an option out of range (named in the message).
    """

    capabilities = RFA.capabilities  # as registered; used when built without the registry

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", num_features: int = 64,
                 feature_map: str = "trig", sigma: float = 1.0, learn_sigma: bool = True,
                 gate: bool = True, gate_init: float = 0.9, orthogonal: bool = False,
                 seed: int | None = None, chunk_size: int = 64) -> None:
        check_int("num_features", num_features)
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend,
                         chunk_size=chunk_size)
        if num_heads is None:
            raise InvalidInputError(
                "RandomFeatureAttention: num_heads: expected the number of heads H (the gate and sigma are "
                "per head), got None"
            )
        self.num_random = num_features
        self.feature_map = check_choice("feature_map", feature_map, FEATURE_MAPS)
        if scale is not None:
            sigma = scale ** -0.5
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
            raise InvalidInputError(f"sigma: expected a float > 0, got {sigma!r}")
        if isinstance(gate_init, bool) or not isinstance(gate_init, (int, float)) or not 0 < gate_init < 1:
            raise InvalidInputError(f"gate_init: expected a float in (0, 1), got {gate_init!r}")
        self.gate = bool(gate)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        w = draw_gaussian_features(num_features, head_dim, orthogonal=orthogonal, generator=gen)
        self.register_buffer("features", w)
        log_sigma = torch.full((num_heads,), math.log(sigma))
        if learn_sigma:
            self.log_sigma = nn.Parameter(log_sigma)
        else:
            self.register_buffer("log_sigma", log_sigma)
        self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.gate_bias = nn.Parameter(torch.full((num_heads,), math.log(gate_init / (1 - gate_init))))

    @property
    def feature_dim(self) -> int:
        """M features per head: 2·num_features for ``"trig"``, else num_features."""
        return 2 * self.num_random if self.feature_map == "trig" else self.num_random

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_features={self.num_random}, feature_map={self.feature_map!r}"

    # ------------------------------------------------------------ features
    def _phi(self, x: Tensor) -> Tensor:
        H = x.shape[1]
        self._check_heads(H)
        x = F.normalize(x, dim=-1) / self.log_sigma.to(x.dtype).exp().view(1, H, 1, 1)
        p = x @ self.features.to(x.dtype).transpose(0, 1)
        if self.feature_map == "trig":
            return torch.cat([torch.sin(p), torch.cos(p)], dim=-1) * self.num_random ** -0.5
        # positive features; |x| = 1/sigma is the same for every row, so no stabiliser is needed
        return torch.exp(p - 0.5 * (x * x).sum(-1, keepdim=True)) * self.num_random ** -0.5

    def _check_heads(self, H: int) -> None:
        if H != self.num_heads:
            raise InvalidInputError(
                f"{self.impl_name!r} was built with num_heads={self.num_heads} (per-head gate and sigma), "
                f"expected q, k, v with H={self.num_heads} (dim 1), got H={H}"
            )

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q), phi(k))``, ``(B, H, L, M)`` and ``(B, H, S, M)``."""
        return self._phi(q), self._phi(k)

    def gate_logits(self, k: Tensor) -> Tensor:
        """``w_h . k_t + b_h``, ``(B, H, S)``; the gate is ``g_t = sigmoid`` of it."""
        H = k.shape[1]
        self._check_heads(H)
        return torch.einsum("bhsd,hd->bhs", k, self.gate_weight.to(k.dtype)) + self.gate_bias.to(k.dtype).view(1, H, 1)

    # ------------------------------------------------------------ forward
    def _gated(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
               state: tuple[Tensor, Tensor] | None, backend: str = "torch"
               ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        phi_q, phi_k = self._phi(q), self._phi(k)
        keep = key_mask(key_padding_mask, phi_k.dtype)
        if keep is not None:
            phi_k = phi_k * keep
            v = v * keep
        if self.gate:
            logits = self.gate_logits(k)
            log_g = F.logsigmoid(logits)                      # log g_t, stable
            if key_padding_mask is not None:                 # padded keys: g = 1, nothing written
                log_g = log_g.masked_fill(~key_padding_mask[:, None, :], 0.0)
            phi_k = phi_k * torch.sigmoid(-logits).unsqueeze(-1)   # (1 - g_t) phi(k_t)
        else:
            log_g = torch.zeros(k.shape[:3], dtype=k.dtype, device=k.device)
        if backend == "numba" and state is None:
            from .kernels import causal_gated_numba

            num, den = causal_gated_numba(phi_q, phi_k, v, torch.exp(log_g), chunk=self.chunk_size)
            return normalize(num, den), None
        num, den, new_state = chunked.causal_gated(phi_q, phi_k, v, log_g, chunk=self.chunk_size, state=state)
        return normalize(num, den), new_state

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        self.check_head_dim(q)
        if not causal:  # ungated RFA: two matmuls on every backend
            return super()._forward(q, k, v, causal=False, key_padding_mask=key_padding_mask, attn_mask=None)
        out, _ = self._gated(q, k, v, key_padding_mask, None, self.resolve_backend(q, k, v))
        return out

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state):
        self.check_head_dim(q, "step")
        S, z = self._fit_state(state, q, v, self.feature_dim)
        out, (S, z) = self._gated(q, k, v, None, (S, z))
        return out, {"S": S, "z": z, "t": state.get("t", 0) + q.shape[2]}
