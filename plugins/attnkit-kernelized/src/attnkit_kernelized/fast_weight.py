"""``fast-weight`` (alias ``delta``): delta-rule fast weight memory (Schlag, Irie, Schmidhuber 2021).

A linear transformer is a fast weight programmer whose memory only ever
adds ``v_t phi(k_t)^T``. The delta rule also *removes*: it first retrieves
the value currently stored under the key, ``v_bar_t = W_{t-1} phi(k_t)``, and
writes the difference with a learned strength ``beta_t`` in (0, 1)::

    W_t = W_{t-1} + beta_t (v_t - W_{t-1} phi(k_t)) phi(k_t)^T
    out_t = W_t phi(q_t)

(in state form ``S = W^T`` of shape ``(M, E)``:
``S_t = S_{t-1} + beta_t phi(k_t) (v_t - S_{t-1}^T phi(k_t))^T``).

Following the paper: ``phi`` is DPFP-nu by default, ``phi(q)`` and ``phi(k)``
are sum-normalised (``phi(x) / sum_i phi(x)_i``) instead of dividing by a
denominator, which keeps the update a contraction, and
``beta_t = sigmoid(w_h . k_t + b_h)`` is a learned projection (the paper
projects the layer input ``x_t``; here the module sees the per-head key
``k_t``, a linear function of ``x_t``). A fixed ``beta`` can be given instead.

Causal only (there is no non-causal delta rule). Padded keys write nothing
(their features are zeroed, so the update is the identity).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnkit.errors import InvalidInputError

from . import chunked
from ._base import KernelizedAttention, check_choice, check_int, key_mask
from .feature_maps import DETERMINISTIC_MAPS, deterministic_feature_map, feature_dim
from .plugin import FAST_WEIGHT


class FastWeightAttention(KernelizedAttention):
    """Delta-rule fast weight memory (write and remove), causal.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, E)`` ->
    ``(B, H, L, E)``; ``causal=True`` is required (``causal=False`` and L != S
    are refused). CPU tensors run the numba kernel (per-position recurrence,
    checkpointed backward); otherwise the chunked torch form (UT transform).
    Streams exactly through ``init_state``/``step`` (state ``{"S": (B, H, M, E)}``).

    Args:
        num_heads: number of heads H (the learned beta projection is per head; required).
        head_dim: head dimension D (required).
        scale: None (default) leaves queries as they are, as in the paper; a
            float multiplies the output (queries are sum-normalised, so a query
            scale would cancel).
        backend: ``"auto"`` (numba for CPU tensors, else torch), ``"torch"`` or ``"numba"``.
        feature_map: ``"dpfp"`` (the paper's DPFP-nu, 2·D·dpfp_nu features),
            ``"elu"``, ``"relu"`` or ``"softplus"`` (D features).
        dpfp_nu: rolls of the ``"dpfp"`` map.
        normalize: sum-normalise ``phi(q)`` and ``phi(k)`` (the paper's; keeps
            the update stable).
        beta: None (default) learns ``beta_t = sigmoid(w_h . k_t + b_h)``, the
            paper's; a float in (0, 1] fixes beta for every position.
        chunk_size: positions per chunk of the torch form (and checkpoint
            interval of the numba backward).

    Raises:
        InvalidInputError: an option out of range (named in the message).
    """

    capabilities = FAST_WEIGHT.capabilities  # as registered; used when built without the registry

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", feature_map: str = "dpfp",
                 dpfp_nu: int = 1, normalize: bool = True, beta: float | None = None,
                 chunk_size: int = 64) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend,
                         chunk_size=chunk_size)
        if num_heads is None:
            raise InvalidInputError(
                "FastWeightAttention: num_heads: expected the number of heads H (beta is projected per head), "
                "got None"
            )
        self.feature_map = check_choice("feature_map", feature_map, DETERMINISTIC_MAPS)
        self.dpfp_nu = check_int("dpfp_nu", dpfp_nu)
        if dpfp_nu != 1 and feature_map != "dpfp":
            raise InvalidInputError(
                f"dpfp_nu: expected 1 unless feature_map='dpfp' (only DPFP takes it), "
                f"got dpfp_nu={dpfp_nu} with feature_map={feature_map!r}"
            )
        self.normalize = bool(normalize)
        self._phi = deterministic_feature_map(feature_map, nu=self.dpfp_nu)
        if beta is not None and (isinstance(beta, bool) or not isinstance(beta, (int, float))
                                 or not 0 < beta <= 1):
            raise InvalidInputError(f"beta: expected None (learned) or a float in (0, 1], got {beta!r}")
        self.fixed_beta = None if beta is None else float(beta)
        if beta is None:
            self.beta_weight = nn.Parameter(torch.randn(num_heads, head_dim) / math.sqrt(head_dim))
            self.beta_bias = nn.Parameter(torch.zeros(num_heads))

    @property
    def feature_dim(self) -> int:
        return feature_dim(self.feature_map, self.head_dim, nu=self.dpfp_nu)

    def extra_repr(self) -> str:
        beta = "learned" if self.fixed_beta is None else self.fixed_beta
        return f"{super().extra_repr()}, feature_map={self.feature_map!r}, beta={beta}"

    # ------------------------------------------------------------ pieces
    def normalized_features(self, x: Tensor) -> Tensor:
        """``phi(x)``, sum-normalised when ``normalize`` (a row of zeros stays zero), ``(..., M)``."""
        f = self._phi(x)
        if self.normalize:
            s = f.sum(-1, keepdim=True)
            f = f / torch.where(s == 0, torch.ones_like(s), s)
        return f

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.normalized_features(q), self.normalized_features(k)

    def betas(self, k: Tensor) -> Tensor:
        """Write strengths ``beta_t``, ``(B, H, L)``."""
        B, H, L, _ = k.shape
        if self.fixed_beta is not None:
            return torch.full((B, H, L), self.fixed_beta, dtype=k.dtype, device=k.device)
        if H != self.num_heads:
            raise InvalidInputError(
                f"{self.impl_name!r} was built with num_heads={self.num_heads} (per-head beta projection), "
                f"expected q, k, v with H={self.num_heads} (dim 1), got H={H}"
            )
        logits = torch.einsum("bhld,hd->bhl", k, self.beta_weight.to(k.dtype))
        return torch.sigmoid(logits + self.beta_bias.to(k.dtype).view(1, H, 1))

    def _prepare(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None):
        phi_q, phi_k = self.feature_pair(q, k, causal=True)
        beta = self.betas(k)
        keep = key_mask(key_padding_mask, phi_k.dtype)
        if keep is not None:
            phi_k = phi_k * keep
            v = v * keep
        return phi_q, phi_k, v, beta

    def _scale_out(self, out: Tensor) -> Tensor:
        return out if self.scale is None else out * self.scale

    # ------------------------------------------------------------ forward
    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        self.check_head_dim(q)
        phi_q, phi_k, v, beta = self._prepare(q, k, v, key_padding_mask)
        backend = self.resolve_backend(q, k, v)
        if backend == "numba":
            from .kernels import causal_delta_numba

            out = causal_delta_numba(phi_q, phi_k, v, beta, chunk=self.chunk_size)
        else:
            out, _ = chunked.causal_delta(phi_q, phi_k, v, beta, chunk=self.chunk_size)
        return self._scale_out(out)

    def _init_state(self, batch, *, device, dtype):
        dtype = dtype or torch.get_default_dtype()
        return {"S": torch.zeros(batch, self.num_heads, self.feature_dim, self.head_dim, device=device,
                                 dtype=dtype), "t": 0}

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state):
        self.check_head_dim(q, "step")
        if not isinstance(state, dict) or "S" not in state:
            raise InvalidInputError(
                f"step: state must be the dict returned by init_state()/step() of {self.impl_name!r}, "
                f"got {type(state).__name__}"
            )
        B, H, _, _ = q.shape
        want = (B, H, self.feature_dim, v.shape[-1])
        S = state["S"]
        if tuple(S.shape) != want:
            if state.get("t", 0) != 0:
                raise InvalidInputError(
                    f"step: the state holds S of shape {tuple(S.shape)} = (B, H, M, E), expected {want}"
                )
            S = q.new_zeros(want)
        phi_q, phi_k, v, beta = self._prepare(q, k, v, None)
        out, S = chunked.causal_delta(phi_q, phi_k, v, beta, chunk=self.chunk_size, state=S.to(q.dtype))
        return self._scale_out(out), {"S": S, "t": state.get("t", 0) + q.shape[2]}
