"""``linear``: :class:`LinearAttention`, its options and dispatch.

``out_i = phi(q_i)^T sum_j phi(k_j) v_j^T / phi(q_i) . sum_j phi(k_j)``, with
``phi(x) = elu(x) + 1`` by default. O(L·M·E) time; the causal form is a
prefix sum whose running state ``(S, z)`` streams exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit.errors import InvalidInputError

from .._ops import runnable_backend
from ..base import KernelizedAttention
from ..common import padded, zero_padded
from ..feature_maps import DETERMINISTIC_MAPS, deterministic_feature_map, feature_dim
from ..options import check_choice, check_int
from ..plugin import LINEAR


class LinearAttention(KernelizedAttention):
    """Linear attention, ``phi(q) (phi(k)^T v) / (phi(q) . sum_j phi(k_j))``.

    Shapes as in :func:`torch.nn.functional.scaled_dot_product_attention`:
    q ``(B, H, L, D)``, k ``(B, H, S, D)``, v ``(B, H, S, E)`` -> ``(B, H, L, E)``.
    Non-causal (also cross-attention, L != S) and causal (L == S, a prefix
    sum). Every backend runs both: ``torch`` (two matmuls; the chunked causal
    form), ``numba`` (CPU kernels) and ``triton`` (CUDA kernels). Padded keys
    add nothing; a query that sees no key gives 0. ``attn_mask`` is refused.

    Args:
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; None accepts any D (no parameters depend on it).
        scale: None (default) applies no scaling, as in the paper; a float
            multiplies q and k by ``sqrt(scale)`` before the feature map.
        backend: ``"auto"`` (triton for CUDA tensors, numba for CPU tensors), or
            one of ``"torch"``, ``"numba"``, ``"triton"`` (always that backend, or an error).
        feature_map: ``"elu"`` (elu(x) + 1, the paper's), ``"relu"``,
            ``"softplus"`` or ``"dpfp"`` (Schlag et al. 2021; 2·D·dpfp_nu features).
        dpfp_nu: rolls of the ``"dpfp"`` map (must stay 1 with the other maps).
        chunk_size: positions per chunk of the causal forms (torch chunks, kernel blocks).

    Raises:
        InvalidInputError: an option of the wrong type or out of range (named in the message).
    """

    #: ranges and choices checked by attnkit.build before the module is built (the constructor checks again)
    option_constraints = {"feature_map": {"choices": DETERMINISTIC_MAPS}, "dpfp_nu": {"minimum": 1}}

    capabilities = LINEAR.capabilities  # the spec's one declaration; used when built without the registry

    #: one segment however long the sequence: the features are the size of q (M = D; 2·D·dpfp_nu for dpfp), so
    #: segments save little memory, and they cost copies of the cut inputs for the kernels and a concatenation
    #: of the outputs (unsegmented was ~20% faster at L = 8,192 and ~8% at 16,384, numba, 2 threads; session 25)
    segment_length: ClassVar[int] = 1 << 62
    cuda_segment_length: ClassVar[int] = 1 << 62

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", feature_map: str = "elu",
                 dpfp_nu: int = 1, chunk_size: int = 64) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend,
                         chunk_size=chunk_size, needs_head_dim=False)
        self.feature_map = check_choice("feature_map", feature_map, DETERMINISTIC_MAPS)
        self.dpfp_nu = check_int("dpfp_nu", dpfp_nu)
        if dpfp_nu != 1 and feature_map != "dpfp":
            raise InvalidInputError(
                f"dpfp_nu: expected 1 unless feature_map='dpfp' (only DPFP takes it), "
                f"got dpfp_nu={dpfp_nu} with feature_map={feature_map!r}")
        self._phi = deterministic_feature_map(feature_map, nu=self.dpfp_nu)

    def feature_count(self, head_dim: int) -> int:
        return feature_dim(self.feature_map, head_dim, nu=self.dpfp_nu)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, feature_map={self.feature_map!r}"

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q), phi(k))`` of shapes ``(B, H, L, M)`` and ``(B, H, S, M)``; 0 at padded keys."""
        if self.scale is not None:
            s = self.scale ** 0.5
            q, k = q * s, k * s
        return self._phi(q), zero_padded(self._phi(k), padded(key_padding_mask))

    def _segment_features(self, q: Tensor, k: Tensor, kpm: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
        """On the numba backend's unfused path the ``elu`` map runs as one numba pass per tensor (:mod:`.numba_elu`:
        torch's ``F.elu(x) + 1`` is two passes and its backward a third); the same values, rounding aside. The module
        takes the fused forms (:meth:`_fused_causal`, :meth:`_trained_causal`) wherever this applies; the unfused
        path runs when they are switched off (the benchmarks' baseline, the tests' comparison)."""
        if (backend != "numba" or self.feature_map != "elu" or q.dtype not in (torch.float32, torch.float64)
                or q.device.type != "cpu" or torch.compiler.is_compiling()):
            return super()._segment_features(q, k, kpm, backend)
        from .numba_elu import elu_plus_one

        if self.scale is not None:
            s = self.scale ** 0.5
            q, k = q * s, k * s
        return elu_plus_one(q), zero_padded(elu_plus_one(k), padded(kpm))

    def _causal_segment(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any]:
        out = self._trained_causal(q, k, v, kpm, state, backend)
        return out if out is not None else super()._causal_segment(q, k, v, kpm, state, backend)

    def _trained_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any] | None:
        """The ``elu`` map's causal form on the numba backend, float32/float64, as one differentiable operator:
        the fused kernel's forward, which also keeps the features, and a backward that runs the map's backward on
        the blocks of its products (:mod:`.numba_train`); or None (the map and linear attention as separate
        operators). What the no-grad path (:meth:`_fused_causal`) leaves: calls under autograd, and compiled or
        exported ones."""
        if (self.feature_map != "elu" or q.device.type != "cpu" or q.shape[2] == 0
                or q.dtype not in (torch.float32, torch.float64) or not k.dtype == v.dtype == q.dtype):
            return None
        if runnable_backend(backend, q, k, v) != "numba":
            return None
        from .numba_train import linear_causal

        S0, z0 = (None, None) if state is None else state
        scale = 1.0 if self.scale is None else self.scale ** 0.5
        out, S, z = linear_causal(q, k, v, scale, padded(kpm), S0, z0, self.chunk_size)
        return out, (S, z)

    def _segments(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                  backend: str) -> tuple[Tensor, Any]:
        out = self._fused_causal(q, k, v, kpm, state, backend)
        return out if out is not None else super()._segments(q, k, v, kpm, state, backend)

    def _fused_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                      backend: str) -> tuple[Tensor, Any] | None:
        """The ``elu`` map's causal form without autograd on the numba backend: the whole sequence in one kernel
        call that forms each block's features in cache and never writes them (:mod:`.numba_fused`), or None (the
        unfused path). Taken when no input (state included) needs a gradient."""
        if (self.feature_map != "elu" or torch.compiler.is_compiling() or q.device.type != "cpu"
                or q.dtype not in (torch.float32, torch.float64) or q.shape[2] == 0):
            return None
        tensors = (q, k, v) if state is None else (q, k, v, *state)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None
        if runnable_backend(backend, q, k, v) != "numba":
            return None
        from .numba_fused import fused_causal

        S0, z0 = (None, None) if state is None else state
        scale = 1.0 if self.scale is None else self.scale ** 0.5
        out, S, z = fused_causal(q, k, v, scale, padded(kpm), S0, z0, self.chunk_size)
        return out, (S, z)

    def _cp_summary(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, backend: str
                    ) -> tuple[Tensor, ...]:
        """The chunk's additions to the state, ``S = phi(k)^T v (B, H, M, E)`` and ``z = sum phi(k) (B, H, M)``."""
        _, phi_k = self.feature_pair(q, k, causal=True, key_padding_mask=kpm)
        return phi_k.transpose(-1, -2) @ v, phi_k.sum(dim=2)
