"""``rfa``: :class:`RandomFeatureAttention` (Peng et al. 2021), its options, features, gate and dispatch.

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
cross-attention) is ungated RFA, as in the paper: linear attention on these
features (the ``linear`` backends).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._ops import backend_module, kernel_inputs, runnable_backend
from ..base import KernelizedAttention
from ..common import padded, zero_padded
from ..feature_maps import draw_gaussian_features, favor_positive, random_fourier
from ..options import check_bool, check_choice, check_float, check_int, check_seed
from ..plugin import RFA
from .recurrent import gated_attention_step

FEATURE_MAPS = ("trig", "positive")


class RandomFeatureAttention(KernelizedAttention):
    """RFA: random-feature attention, gated in its causal form.

    Shapes as in :func:`torch.nn.functional.scaled_dot_product_attention`:
    q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.
    Causal (L == S): the gated recurrence, on the ``numba`` backend (CPU
    kernels), the ``triton`` backend (CUDA kernels of the chunked form) or the
    ``torch`` backend (chunked form), streamed exactly through
    ``init_state``/``step`` and ``forward(..., state=..., return_state=True)``.
    Non-causal (also L != S): ungated RFA (linear attention on the features,
    the ``linear`` kernels or two matmuls). ``attn_mask`` is refused.

    Args:
        num_heads: number of heads H (the gate and sigma are per head; required).
        head_dim: head dimension D the random features and gate are drawn for (required).
        scale: None (default) starts sigma at ``sigma``; a float starts it at
            ``scale ** -0.5`` (the kernel is then ``exp(scale · cos-sim)`` up to a constant).
        backend: ``"auto"`` (triton for CUDA tensors, numba for CPU tensors), or one of ``"torch"``,
            ``"numba"``, ``"triton"`` (always that backend, or an error).
        num_features: number of random frequencies M (>= 1); ``"trig"`` gives
            2·M features (sin and cos).
        feature_map: ``"trig"`` (random Fourier features, the paper's; not
            positive, so the denominator can vanish) or ``"positive"`` (FAVOR+
            positive features of the normalised inputs, always > 0).
        sigma: initial kernel width sigma (a finite float > 0).
        learn_sigma: learn ``log sigma`` per head (True) or keep it fixed.
        gate: use the learned gate in the causal form (False: ungated causal RFA,
            ``S_t = S_{t-1} + phi(k_t) v_t^T``, and no gate parameters). The non-causal
            form is ungated; it ties the gate parameters into its graph with a zero
            gradient, so DistributedDataParallel finds every parameter used in both forms.
        gate_init: initial gate value g in (0, 1) (bias ``logit(g)``, weights 0).
        orthogonal: draw the random frequencies orthogonal in blocks of D.
        seed: draw the frequencies from ``torch.Generator().manual_seed(seed)``
            (an int >= 0); None uses torch's global RNG.
        chunk_size: positions per chunk of the causal forms (checkpoint interval of the numba backward).

    Raises:
        InvalidInputError: an option of the wrong type or out of range (named in the message).
    """

    #: ranges and choices checked by attnkit.build before the module is built (the constructor checks again)
    option_constraints = {"num_features": {"minimum": 1}, "feature_map": {"choices": FEATURE_MAPS},
                          "sigma": {"minimum": 0, "exclusive_minimum": True},
                          "gate_init": {"minimum": 0, "maximum": 1, "exclusive_minimum": True,
                                        "exclusive_maximum": True}, "seed": {"minimum": 0}}

    capabilities = RFA.capabilities  # the spec's one declaration; used when built without the registry
    float32_buffers = ("features", "log_sigma")   # log_sigma is a buffer only with learn_sigma=False

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", num_features: int = 64,
                 feature_map: str = "trig", sigma: float = 1.0, learn_sigma: bool = True,
                 gate: bool = True, gate_init: float = 0.9, orthogonal: bool = False,
                 seed: int | None = None, chunk_size: int = 64) -> None:
        check_int("num_features", num_features)
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend,
                         chunk_size=chunk_size, needs_heads=True)
        self.num_random = num_features
        self.feature_map = check_choice("feature_map", feature_map, FEATURE_MAPS)
        sigma = check_float("sigma", sigma, low=0.0)
        if self.scale is not None:
            sigma = self.scale ** -0.5
        check_bool("learn_sigma", learn_sigma)
        self.gate = check_bool("gate", gate)
        gate_init = check_float("gate_init", gate_init, low=0.0, high=1.0)
        check_bool("orthogonal", orthogonal)
        seed = check_seed("seed", seed)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        w = draw_gaussian_features(num_features, head_dim, orthogonal=orthogonal, generator=gen)
        self.register_buffer("features", w)
        log_sigma = torch.full((num_heads,), math.log(sigma))
        if learn_sigma:
            self.log_sigma = nn.Parameter(log_sigma)
        else:
            self.register_buffer("log_sigma", log_sigma)
        if self.gate:  # parameters exist only where a form uses them (DDP reduces every parameter)
            self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim))
            self.gate_bias = nn.Parameter(torch.full((num_heads,), math.log(gate_init / (1 - gate_init))))

    def backend_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """``auto``: the triton kernels first on CUDA, numba first elsewhere (the declared order).

        Measured on an H200 (docs/benchmarks.md, "GPU run 6"), B = 1, H = 8, D = 64, 128 frequencies, causal:
        the chunk-parallel gated kernels against the chunked torch form 3.1-5.2x forward and 2.8-4.7x
        forward+backward, bfloat16 and float32, L = 16,384 and 65,536.
        """
        if device.type == "cuda":
            return ("triton", *(b for b in self.caps.backends if b != "triton"))
        return tuple(self.caps.backends)

    def feature_count(self, head_dim: int) -> int:
        """M features per head: 2·num_features for ``"trig"``, else num_features."""
        return 2 * self.num_random if self.feature_map == "trig" else self.num_random

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_features={self.num_random}, feature_map={self.feature_map!r}"

    # ------------------------------------------------------------ features
    def phi(self, x: Tensor) -> Tensor:
        """Features of ``x (B, H, L, D)``: l2-normalised, divided by the head's sigma, mapped, ``(B, H, L, M)``."""
        x = F.normalize(x, dim=-1) / self.log_sigma.to(x.dtype).exp().view(1, -1, 1, 1)
        w = self.features.to(x.dtype)
        # positive features need no stabiliser: |x| = 1/sigma is the same for every row
        return random_fourier(x, w) if self.feature_map == "trig" else favor_positive(x, w)

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q), phi(k))``, ``(B, H, L, M)`` and ``(B, H, S, M)``; 0 at padded keys."""
        return self.phi(q), zero_padded(self.phi(k), padded(key_padding_mask))

    def gate_logits(self, k: Tensor) -> Tensor:
        """``w_h . k_t + b_h``, ``(B, H, S)``; the gate is ``g_t = sigmoid`` of it."""
        return (k * self.gate_weight.to(k.dtype)[None, :, None, :]).sum(-1) + self.gate_bias.to(k.dtype).view(1, -1, 1)

    def gated_inputs(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None
                     ) -> tuple[Tensor, Tensor, Tensor]:
        """``(phi(q), (1 - g) phi(k), log g)`` of the causal form; padded keys: ``phi(k) = 0``, ``g = 1``."""
        phi_q, phi_k = self.feature_pair(q, k, causal=True, key_padding_mask=key_padding_mask)
        if not self.gate:
            return phi_q, phi_k, k.new_zeros(k.shape[:3])
        logits = self.gate_logits(k)
        log_g = F.logsigmoid(logits)                                  # log g_t, stable
        pad = padded(key_padding_mask)
        phi_k = zero_padded(phi_k * torch.sigmoid(-logits).unsqueeze(-1), pad)   # (1 - g_t) phi(k_t)
        if pad is not None:                                           # padded keys: g = 1, nothing written
            log_g = log_g.masked_fill(pad[..., 0], 0.0)
        return phi_q, phi_k, log_g

    # ------------------------------------------------------------ forward
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: Any) -> Any:
        out = super()._attend(q, k, v, ctx)
        if ctx.causal or not self.gate:
            return out
        # the ungated non-causal form: the gate parameters join the graph with an exactly zero value and
        # gradient (a select, not 0 * p: a NaN parameter cannot reach the output), so DDP sees them used
        params = self.gate_weight.sum() + self.gate_bias.sum()
        return out + torch.where(torch.zeros((), dtype=torch.bool, device=out.device), params.to(out.dtype),
                                 torch.zeros((), dtype=out.dtype, device=out.device))

    def _causal_segment(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any]:
        phi_q, phi_k, log_g = self.gated_inputs(q, k, kpm)
        backend = runnable_backend(backend, phi_q, phi_k, v, log_g)
        S0, z0 = (None, None) if state is None else state
        phi_q, phi_k, v = kernel_inputs(backend, phi_q, phi_k, v)     # the gate's log g stays float32
        out, S, z = backend_module("rfa", backend).gated_attention(phi_q, phi_k, v, log_g, S0, z0,
                                                                   chunk=self.chunk_size)
        return out, (S, z)

    def _cp_summary(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, backend: str
                    ) -> tuple[Tensor, ...]:
        """``(S, z)`` after the chunk from zeros and ``log G = sum_t log g_t (B, H)``: the chunk maps a
        state ``(S0, z0)`` to ``(G S0 + S, G z0 + z)``."""
        S, z = super()._cp_summary(q, k, v, kpm, backend)
        _, _, log_g = self.gated_inputs(q, k, kpm)
        return S, z, log_g.sum(dim=2)

    def _cp_combine(self, a: Any, b: Any) -> tuple[Tensor, ...]:
        (Sa, za, ga), (Sb, zb, gb) = a, b
        decay = gb.exp()
        return decay[..., None, None] * Sa + Sb, decay[..., None] * za + zb, ga + gb

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        S, z = self._state_in(state, q, v) or self._zero_state(q, v)
        phi_q, phi_k, log_g = self.gated_inputs(q, k, None)
        out, S, z = gated_attention_step(phi_q, phi_k, v, log_g, S, z)
        return out, {"S": S, "z": z}
