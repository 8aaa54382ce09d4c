"""``fast-weight`` (alias ``delta``): :class:`FastWeightAttention` (Schlag, Irie, Schmidhuber 2021).

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
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit.errors import InvalidInputError

from .._ops import backend_module, kernel_inputs, runnable_backend
from ..base import KernelizedAttention
from ..common import padded, zero_padded
from ..feature_maps import DETERMINISTIC_MAPS, deterministic_feature_map, feature_dim, sum_normalized
from ..options import check_bool, check_choice, check_float, check_int
from ..plugin import FAST_WEIGHT
from .recurrent import delta_rule_step


class FastWeightAttention(KernelizedAttention):
    """Delta-rule fast weight memory (write and remove), causal.

    Shapes: q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, E)`` ->
    ``(B, H, L, E)``; ``causal=True`` is required (``causal=False`` and L != S
    are refused). Backends: ``numba`` (CPU kernels of the chunked UT-transform
    form on register panels, forward and backward from checkpoints; fused with
    the feature map when no gradient is needed),
    ``triton`` (CUDA kernels of the chunked UT-transform form, forward and
    backward) and ``torch`` (the chunked UT-transform form). Streams exactly through ``init_state``/``step`` and
    ``forward(..., state=..., return_state=True)`` (state ``{"S": (B, H, M, E)}``).

    Args:
        num_heads: number of heads H (the learned beta projection is per head; required).
        head_dim: head dimension D (required).
        scale: None (default) leaves queries as they are, as in the paper; a
            float multiplies the output (queries are sum-normalised, so a query
            scale would cancel).
        backend: ``"auto"`` (triton for CUDA tensors, numba for CPU tensors), or one of ``"torch"``,
            ``"numba"``, ``"triton"`` (always that backend, or an error). On CPU the numba kernels
            measured faster than the chunked torch form (``benchmarks/bench_fast_weight.py`` at L = 8K on a
            2-core EPYC; docs/benchmarks.md, "Session 64"), so ``auto`` keeps numba there; triton runs on
            CUDA, the torch form on other devices, under ``torch.func`` transforms and ``torch.compile``.
        feature_map: ``"dpfp"`` (the paper's DPFP-nu, 2·D·dpfp_nu features),
            ``"elu"``, ``"relu"`` or ``"softplus"`` (D features).
        dpfp_nu: rolls of the ``"dpfp"`` map (must stay 1 with the other maps).
        normalize: sum-normalise ``phi(q)`` and ``phi(k)`` (a bool; the paper's,
            keeps the update stable).
        beta: None (default) learns ``beta_t = sigmoid(w_h . k_t + b_h)``, the
            paper's; a float in (0, 1] fixes beta for every position.
        chunk_size: positions per chunk of the torch form and of the triton
            kernels (there rounded to a power of two in [16, 64] for half inputs,
            [16, 32] otherwise), and checkpoint interval of the numba backward (the
            numba forward runs blocks of 16 positions within it); on CPU the torch
            form measured fastest at 32.

    Raises:
        InvalidInputError: an option of the wrong type or out of range (named in the message).
    """

    #: ranges and choices checked by attnkit.build before the module is built (the constructor checks again)
    option_constraints = {"feature_map": {"choices": DETERMINISTIC_MAPS}, "dpfp_nu": {"minimum": 1},
                          "beta": {"minimum": 0, "maximum": 1, "exclusive_minimum": True}}

    capabilities = FAST_WEIGHT.capabilities  # the spec's one declaration; used when built without the registry
    state_keys: ClassVar[tuple[str, ...]] = ("S",)
    #: positions per causal segment of the training operator on the CPU (:meth:`_trained_causal`, numba), in place
    #: of :attr:`segment_length`. Each segment boundary costs copies of the segment's q, k, v and g_out and
    #: concatenations of the output and the gradients; the features are saved for the backward whatever the
    #: segment, so a longer one adds only the backward's transients (as the performer's, whose value this is).
    #: Session 66 (2 vCPUs, L = 8,192, B = 1, H = 8, D = 64, DPFP, M = 128, alternated in one process): a training
    #: step 1.11x faster in one 8,192-position segment than in 2,048-position ones, 1.41x with a second process
    #: keeping the cores busy
    trained_segment_length: ClassVar[int] = 8192

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto", feature_map: str = "dpfp",
                 dpfp_nu: int = 1, normalize: bool = True, beta: float | None = None,
                 chunk_size: int = 64) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend,
                         chunk_size=chunk_size, needs_heads=True)
        self.feature_map = check_choice("feature_map", feature_map, DETERMINISTIC_MAPS)
        self.dpfp_nu = check_int("dpfp_nu", dpfp_nu)
        if dpfp_nu != 1 and feature_map != "dpfp":
            raise InvalidInputError(
                f"dpfp_nu: expected 1 unless feature_map='dpfp' (only DPFP takes it), "
                f"got dpfp_nu={dpfp_nu} with feature_map={feature_map!r}")
        self.normalize = check_bool("normalize", normalize)
        self.fixed_beta = check_float("beta", beta, low=0.0, high=1.0, high_inclusive=True, allow_none=True)
        self._phi = deterministic_feature_map(feature_map, nu=self.dpfp_nu)
        if beta is None:
            self.beta_weight = nn.Parameter(torch.randn(num_heads, head_dim) / math.sqrt(head_dim))
            self.beta_bias = nn.Parameter(torch.zeros(num_heads))

    def backend_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """``auto``: the triton kernels first on CUDA, numba first elsewhere (the declared order).

        Measured on an H100 (docs/benchmarks.md, "GPU run 5"), B = 1, H = 8, D = 64, L = 16,384 and 65,536: the
        triton kernels against the chunked torch form 2.9-6.5x forward and 3.1-4.8x forward+backward in bfloat16
        and float32. The other kernelized mechanisms keep the declared order (torch on CUDA), where the same run
        measured their torch forms as fast or faster in training.
        """
        if device.type == "cuda":
            return ("triton", *(b for b in self.caps.backends if b != "triton"))
        return tuple(self.caps.backends)

    def feature_count(self, head_dim: int) -> int:
        return feature_dim(self.feature_map, head_dim, nu=self.dpfp_nu)

    def extra_repr(self) -> str:
        beta = "learned" if self.fixed_beta is None else self.fixed_beta
        return f"{super().extra_repr()}, feature_map={self.feature_map!r}, beta={beta}"

    # ------------------------------------------------------------ pieces
    def phi(self, x: Tensor) -> Tensor:
        """``phi(x)``, sum-normalised when ``normalize`` (a row of zeros stays zero), ``(..., M)``."""
        f = self._phi(x)
        return sum_normalized(f) if self.normalize else f

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q), phi(k))``; 0 at padded keys (they write nothing)."""
        return self.phi(q), zero_padded(self.phi(k), padded(key_padding_mask))

    def betas(self, k: Tensor) -> Tensor:
        """Write strengths ``beta_t``, ``(B, H, L)``."""
        B, H, L, _ = k.shape
        if self.fixed_beta is not None:
            return torch.full((B, H, L), self.fixed_beta, dtype=k.dtype, device=k.device)
        logits = (k * self.beta_weight.to(k.dtype)[None, :, None, :]).sum(-1)   # w_h . k_t
        return torch.sigmoid(logits + self.beta_bias.to(k.dtype).view(1, H, 1))

    def _scale_out(self, out: Tensor) -> Tensor:
        return out if self.scale is None else out * self.scale

    # ------------------------------------------------------------ forward
    def _segment_features(self, q: Tensor, k: Tensor, kpm: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
        """On the numba backend's unfused path the feature map and its normalisation run as one numba pass per
        tensor (:mod:`.numba_features`; torch's DPFP is five passes forward and as many backward): the values the
        fused kernels compute. The module takes the fused forms (:meth:`_fused_causal`, :meth:`_trained_causal`)
        wherever this applies; the unfused path runs when they are switched off (the benchmarks' baseline, the tests'
        comparison). DPFP with more rolls than D stays on torch's map (the kernels wrap a roll once)."""
        if (backend != "numba" or q.dtype not in (torch.float32, torch.float64) or q.device.type != "cpu"
                or torch.compiler.is_compiling() or self.dpfp_nu > q.shape[-1]):
            return self.feature_pair(q, k, causal=True, key_padding_mask=kpm)
        from .numba_features import phi

        kw = dict(feature_map=self.feature_map, nu=self.dpfp_nu, normalize=self.normalize)
        return phi(q, **kw), zero_padded(phi(k, **kw), padded(kpm))

    def _causal_segment(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any]:
        trained = self._trained_causal(q, k, v, kpm, state, backend)
        if trained is not None:
            return trained
        phi_q, phi_k = self._segment_features(q, k, kpm, runnable_backend(backend, q, k, v))
        beta = self.betas(k)
        backend = runnable_backend(backend, phi_q, phi_k, v, beta)
        S0 = None if state is None else state[0]
        phi_q, phi_k, v = kernel_inputs(backend, phi_q, phi_k, v)     # beta stays float32
        out, S = backend_module("fast_weight", backend).delta_rule(phi_q, phi_k, v, beta, S0, chunk=self.chunk_size)
        return self._scale_out(out), (S,)

    def _trained_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any] | None:
        """A causal segment on the numba backend, float32/float64, as one differentiable operator: the map and the
        delta rule per sequence, the map's backward after the delta rule's on each sequence's rows
        (:mod:`.numba_train`); or None (the map and the delta rule as separate operators). What the no-grad path
        (:meth:`_fused_causal`) leaves: calls under autograd. Not under ``torch.compile`` (the torch form runs
        there, as with the unfused path) nor for DPFP with more rolls than D (the kernels wrap a roll once)."""
        if not self._trains_fused(q, k, v, backend):
            return None
        from .numba_train import fast_weight_causal

        beta = self.betas(k)
        out, S = fast_weight_causal(q, k, v, beta, padded(kpm), None if state is None else state[0],
                                    chunk=self.chunk_size, feature_map=self.feature_map, nu=self.dpfp_nu,
                                    normalize=self.normalize)
        return self._scale_out(out), (S,)

    def _trains_fused(self, q: Tensor, k: Tensor, v: Tensor, backend: str) -> bool:
        """Whether a causal segment runs as :meth:`_trained_causal`."""
        return (not torch.compiler.is_compiling() and q.device.type == "cpu"
                and q.dtype in (torch.float32, torch.float64) and q.shape[2] > 0 and self.dpfp_nu <= q.shape[-1]
                and runnable_backend(backend, q, k, v) == "numba")

    def _segments(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                  backend: str) -> tuple[Tensor, Any]:
        out = self._fused_causal(q, k, v, kpm, state, backend)
        if out is not None:
            return out
        seg = self.trained_segment_length if self._trains_fused(q, k, v, backend) else None
        return super()._segments(q, k, v, kpm, state, backend, seg)

    def _fused_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                      backend: str) -> tuple[Tensor, Any] | None:
        """The causal form without autograd on the numba backend: the whole sequence in one kernel call that forms
        each block's features in cache and never writes them (:mod:`.numba_fused`), or None (the unfused path).
        Taken when no input (state and parameters included) needs a gradient."""
        if (torch.compiler.is_compiling() or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64)
                or q.shape[2] == 0 or self.dpfp_nu > q.shape[-1]):
            return None
        tensors = (q, k, v, *self.parameters()) if state is None else (q, k, v, *state, *self.parameters())
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None
        if runnable_backend(backend, q, k, v) != "numba":
            return None
        from .numba_fused import fused_causal

        beta = self.betas(k)
        out, S = fused_causal(q, k, v, beta, padded(kpm), None if state is None else state[0],
                              feature_map=self.feature_map, nu=self.dpfp_nu, normalize=self.normalize)
        return self._scale_out(out), (S,)

    def _state_shapes(self, B: int, H: int, M: int, E: int) -> dict[str, tuple[int, ...]]:
        return {"S": (B, H, M, E)}

    def _cp_summary(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, backend: str
                    ) -> tuple[Tensor, ...]:
        """``(D, P)``: the chunk maps a state ``S0`` to ``P S0 + D``. ``D (B, H, M, E)`` is the state after the
        chunk from zeros; ``P = prod_t (I - beta_t phi(k_t) phi(k_t)^T) (B, H, M, M)``, later positions on the
        left, is the same recurrence run on the identity with zero values."""
        (D,) = super()._cp_summary(q, k, v, kpm, backend)
        B, H, L, _ = q.shape
        M = D.shape[-2]
        eye = torch.eye(M, dtype=q.dtype, device=q.device).expand(B, H, M, M).contiguous()
        _, (P,) = self._segments(q, k, q.new_zeros(B, H, L, M), kpm, (eye,), backend)
        return D, P

    def _cp_combine(self, a: Any, b: Any) -> tuple[Tensor, ...]:
        (Da, Pa), (Db, Pb) = a, b
        return Pb @ Da + Db, Pb @ Pa

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        (S,) = self._state_in(state, q, v) or self._zero_state(q, v)
        phi_q, phi_k = self.feature_pair(q, k, causal=True)
        out, S = delta_rule_step(phi_q, phi_k, v, self.betas(k), S)
        return self._scale_out(out), {"S": S}
