"""``performer``: :class:`PerformerAttention` (FAVOR+), its options, features and stabilisers.

``exp(q . k · scale)`` is estimated by ``phi(q) . phi(k)`` with positive
orthogonal random features ``phi(x) = exp(W x - |x|^2/2) / sqrt(M)`` of
``x = sqrt(scale) · q``; attention is then linear attention on these features
(the ``linear`` backends), O(L·M·E) instead of O(L·S·D).

Numerical stabilisation (the features are exponentials; every shift is a
constant that cancels between numerator and denominator, and is detached):

* non-causal, positive map: each feature's maximum over the real (not
  padded) keys, ``mk_m``, is subtracted from the key exponents and added to
  the query exponents, and each query subtracts its own largest exponent
  ``max_m (lq_m + mk_m)``. Every key feature is <= 1, every query feature
  <= 1 with one equal to 1, and that feature's key sum is >= 1: no row
  underflows to zero and nothing overflows, at any input scale (the
  unshifted map gave all-zero rows for q, k scaled by 10 in float32).
  Padded keys never enter a maximum.
* non-causal, trig map: the query factor ``exp(|q|^2/2)`` is a per-row
  constant (left out); the key factor ``exp(|k|^2/2)`` is divided by its
  maximum over the real keys, so every feature is bounded by ``1/sqrt(M)``.
* causal (positive and trig maps, also streaming): the same shifts with a
  *prefix* maximum (over keys up to each position, never a later one), in
  the log-space chunked form of :mod:`.chunk`; the state carries the
  reference ``m`` of its sums (``{"S", "z", "m"}``). The positive map runs
  on the linear kernels instead (unshifted keys) while every key exponent
  lies within :data:`BOUNDED_EXPONENT` (no feature can under- or overflow
  there); the two forms pass the state to each other. A program
  (``torch.export``) on numba makes that choice with ``torch.cond``
  (:meth:`PerformerAttention._program_causal`).
The random projection lives in the ``features`` buffer (state_dict, ``.to()``),
drawn from ``seed`` (or torch's global RNG when ``seed`` is None), and can be
redrawn on demand (:meth:`PerformerAttention.redraw_features`) or every
``redraw_interval`` training-mode forward calls.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit import transforms
from attnkit.transforms import symbolic

from .._ops import backend_module, kernel_inputs, runnable_backend
from ..base import KernelizedAttention
from ..common import padded, zero_padded
from ..feature_maps import draw_gaussian_features, favor_generalized, key_max
from ..options import check_bool, check_choice, check_int, check_seed
from ..plugin import PERFORMER
from .chunk import NO_KEY, log_space_causal

#: the positive map's causal form runs on the linear kernels (no shift of the keys) when every key exponent
#: lies within [-bound, bound] for the dtype (features between e^-bound and e^bound: far from under- and overflow)
#: (by the dtype the kernels read the features in: bfloat16 on triton for bfloat16 inputs, which has float32's range;
#: float16 inputs hand triton float32 features, see _bounded_causal)
BOUNDED_EXPONENT = {torch.bfloat16: 60.0, torch.float32: 60.0, torch.float64: 600.0}

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
    float32_buffers = ("features",)
    #: positions per causal segment of the positive map's training operator on the CPU (:meth:`_trained_causal`,
    #: numba, a call that records autograd), in place of :attr:`segment_length`. Each segment boundary costs
    #: copies of the segment's q, k, v and g_out and concatenations of the output and the gradients; the features
    #: are saved for the backward whatever the segment, so a longer one adds only the backward's transients.
    #: Session 62 (2 vCPUs, L = 8,192, B = 1, H = 8, D = 64, M = 256, medians of alternated rounds): a training step
    #: 176-187 ms in one 8,192-position segment against 197-214 in 2,048-position ones (glibc keeping freed memory;
    #: 200-254 against 217-256 without); at L = 65,536 a step's peak 10% above 2,048's (1,456 against 1,328 MiB
    #: before the output buffers of attnkit.cpu_buffers; one 65,536-position segment: 1,924)
    trained_segment_length: ClassVar[int] = 8192

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

    def log_features(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Features of ``x (B, H, L, D)`` in log space: ``(exponent, multiplier)``.

        positive: ``(W x' - |x'|^2/2 (B, H, L, M), None)``; trig: ``(|x'|^2/2 (B, H, L, 1),
        [sin W x', cos W x'] / sqrt(M) (B, H, L, 2M))``; ``x' = sqrt(scale) x``. The features are
        ``multiplier * exp(exponent)`` (positive: times ``1/sqrt(M)``, a constant that cancels).
        """
        s = self.get_scale(x) ** 0.5                      # features of sqrt(scale)·q, sqrt(scale)·k
        w = self.features.to(x.dtype) * s
        proj = x @ w.transpose(0, 1)
        half_sq = (0.5 * s * s) * (x * x).sum(-1, keepdim=True)
        if self.feature_map == "trig":
            return half_sq, torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) * self.num_random ** -0.5
        return proj - half_sq, None

    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q) (B, H, L, M), phi(k) (B, H, S, M))``, stabilised as the module docstring says (the
        non-causal shifts); 0 at padded keys. The causal forms of the positive and trig maps do not use it."""
        pad = padded(key_padding_mask)
        keep = None if pad is None else ~pad
        if self.feature_map == "generalized":
            s = self.get_scale(q) ** 0.5
            w = self.features.to(q.dtype)
            return favor_generalized(q, w, scale=s), zero_padded(favor_generalized(k, w, scale=s), pad)
        lq, a = self.log_features(q)
        lk, b = self.log_features(k)
        if self.feature_map == "trig":          # a query's exp(|x|^2/2) is a per-row constant: it cancels
            return a, zero_padded(b * torch.exp(lk - key_max(lk, keep)), pad)
        lk_d = lk.detach() if keep is None else lk.detach().masked_fill(~keep, float("-inf"))
        mk = lk_d.amax(-2, keepdim=True) if lk.shape[-2] else lk_d.new_zeros(*lk.shape[:-2], 1, lk.shape[-1])
        mk = torch.where(torch.isneginf(mk), torch.zeros_like(mk), mk)     # (B, H, 1, M), per feature
        t = lq + mk
        phi_q = torch.exp(t - t.detach().amax(-1, keepdim=True))
        return phi_q, zero_padded(torch.exp(lk - mk), pad)

    # ------------------------------------------------------------ causal forms
    @property
    def _log_space(self) -> bool:
        return self.feature_map in ("positive", "trig")

    @property
    def state_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("S", "z", "m") if self._log_space else ("S", "z")

    def _state_shapes(self, B: int, H: int, M: int, E: int) -> dict[str, tuple[int, ...]]:
        shapes = {"S": (B, H, M, E), "z": (B, H, M)}
        if self._log_space:
            shapes["m"] = (B, H, self.num_random if self.feature_map == "positive" else 1)
        return shapes

    def _zero_state(self, q: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        zeros = super()._zero_state(q, v)
        return (*zeros[:2], zeros[2].fill_(NO_KEY)) if self._log_space else zeros

    def _log_space_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                          chunk: int, dynamic: bool | None = None) -> tuple[Tensor, Any]:
        lq, a = self.log_features(q)
        lk, b = self.log_features(k)
        if self.feature_map == "trig":
            lq = torch.zeros_like(lk)           # the query factor exp(|q|^2/2) cancels
        # v may be half here (a triton call on half inputs): the log-space form runs in float32
        return log_space_causal(lq, lk, v.to(lq.dtype), a, b, padded(kpm), state, chunk=chunk, dynamic=dynamic)

    def _causal_segment(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any]:
        if not self._log_space:
            return super()._causal_segment(q, k, v, kpm, state, backend)
        # the bounded form chooses by the data (a branch neither torch.compile nor torch.func.vmap can follow; a
        # program takes it with a torch.cond)
        if self.feature_map == "positive" and not transforms.active():
            if torch.compiler.is_exporting():
                out = self._program_causal(q, k, v, kpm, state, backend)
            elif not torch.compiler.is_compiling():
                out = self._bounded_causal(q, k, v, kpm, state, backend)
            else:
                out = None
            if out is not None:
                return out
        return self._log_space_causal(q, k, v, kpm, state, self.chunk_size)

    def _program_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any] | None:
        """The positive map's causal form in a program (``torch.export``, a static or a dynamic length) on the
        ``numba`` backend: :meth:`_bounded_causal`'s choice by ``torch.cond``; None elsewhere (the log-space form
        alone, :func:`.chunk.log_space_causal`).

        The features come first, from the feature operators of :mod:`.numba_features` (custom operators: the
        program holds them, and they take any length), with their exponent bounds. A ``torch.cond`` runs the
        linear kernels on them when every key exponent and the state's reference lie within
        :data:`BOUNDED_EXPONENT` (:meth:`_bounded_linear`),
        else the log-space form (:func:`.chunk.log_space_causal`), which selects the chunks that grow past
        :data:`.chunk.GROWTH_LIMIT` for their pairwise blocks (none selected: no block) without a condition of
        its own. One condition: each of its branches is traced by dynamo, which made a dynamic export of an
        H = 8, D = 64 layer take ~20 s with three conditions in a row (the log-space form without and with
        pairwise blocks apart), ~30 s with them nested. On inputs of moderate norm the program then costs what
        the eager module's unfused numba path does (the fused kernel has no backward); the log-space form alone,
        what every program ran before, took 8.5x the eager module at L = 4,096 with a dynamic length, 2.6x with a
        static one (docs/benchmarks.md, session 48).
        """
        L = q.shape[2]
        dynamic = symbolic(L)
        if (runnable_backend(backend, q, k, v) != "numba" or q.dtype not in (torch.float32, torch.float64)
                or v.dtype != q.dtype or k.dtype != q.dtype or (not dynamic and L == 0)):
            return None
        from .numba_features import positive_features

        bound = BOUNDED_EXPONENT[q.dtype]
        s = self.get_scale(q) ** 0.5
        phi_q, phi_k, hi, lo, _ = positive_features(q, k, self.features.to(q.dtype) * s, s * s, padded(kpm),
                                                    self.chunk_size)
        # (hi, lo and m carry no gradient: no grad-mode switch, which torch.export's passes split at)
        ok = (lo.amin() >= -bound) & (hi.amax() <= bound)
        if state is not None:
            m0 = state[2].detach()
            ok = ok & ((m0.abs() <= bound) | (m0 <= NO_KEY / 2)).all()
        operands = (q, k, v, phi_q, phi_k, hi) + ((kpm,) if kpm is not None else ()) + (tuple(state) if state else ())

        sizes = [tuple(x.shape) for x in operands]

        def unpack(xs: tuple[Tensor, ...]) -> tuple[Tensor | None, tuple[Tensor, ...] | None]:
            # a branch is traced with every size symbolic, each operand's its own: a static program's are fixed
            # again (the static form's torch.cond takes no symbolic batch or head count: its outputs' strides
            # would not be dense in the sizes); a dynamic one's lengths are one (else the branches' outputs would
            # differ in their sizes, and the program would take a length of its own, asserted >= 2)
            if not dynamic:
                for x, size in zip(xs, sizes, strict=True):
                    for d, n in enumerate(size):
                        torch._check(x.shape[d] == n)
            for x in xs[1:5]:
                torch._check(x.shape[2] == xs[0].shape[2])
            rest = xs[6:]
            if kpm is not None:
                torch._check(rest[0].shape[1] == xs[0].shape[2])
            kpm_ = rest[0] if kpm is not None else None
            st = rest[1:] if kpm is not None else rest
            return kpm_, (tuple(st) if state is not None else None)

        def bounded(*xs: Tensor) -> tuple[Tensor, ...]:
            _, st = unpack(xs)
            out, (S, z, m) = self._bounded_linear(xs[3], xs[4], xs[2], st, xs[5], "numba")
            return out, S, z, m

        def log_space(*xs: Tensor) -> tuple[Tensor, ...]:
            kpm_, st = unpack(xs)
            out, (S, z, m) = self._log_space_causal(xs[0], xs[1], xs[2], kpm_, st, self.chunk_size,
                                                    dynamic=dynamic)
            return out, S.clone(), z.clone(), m.clone()     # (cond outputs may not alias one another)

        out, S, z, m = torch.cond(ok, bounded, log_space, operands)
        return out, (S, z, m)

    def _segments(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                  backend: str, seg: int | None = None) -> tuple[Tensor, Any]:
        out = self._fused_causal(q, k, v, kpm, state, backend)
        if out is not None:
            return out
        if (seg is None and q.device.type == "cpu" and self.feature_map == "positive" and not transforms.active()
                and not torch.compiler.is_compiling()
                and self._trains_fused(runnable_backend(backend, q, k, v), q, k, v, state)):
            seg = self.trained_segment_length
        return super()._segments(q, k, v, kpm, state, backend, seg)

    def _fused_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                      backend: str) -> tuple[Tensor, Any] | None:
        """The positive map's causal form without autograd on the numba backend: the whole sequence in one
        kernel call that forms the features block by block and never writes them (:mod:`.numba_fused`), or None
        (the segments of :meth:`_causal_segment`). Taken when no input (state included) needs a gradient; its
        result is discarded for the segments when a key exponent (or the state's reference) lies beyond
        :data:`BOUNDED_EXPONENT`, as :meth:`_bounded_causal` decides per segment."""
        if (self.feature_map != "positive" or torch.compiler.is_compiling() or q.shape[2] == 0
                or q.dtype not in (torch.float32, torch.float64)):
            return None
        tensors = (q, k, v) if state is None else (q, k, v, *state)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None
        if runnable_backend(backend, q, k, v) != "numba":
            return None
        from .numba_fused import fused_causal

        bound = BOUNDED_EXPONENT[q.dtype]
        if state is not None and not _state_bounded(state[2], bound):
            return None
        S0, z0, m0 = _state_at_zero(None if state is None else tuple(t.detach() for t in state))
        s = self.get_scale(q) ** 0.5
        out, S, z, hi, lo = fused_causal(q, k, v, self.features.to(q.dtype) * s, s * s, padded(kpm), S0, z0,
                                         self.chunk_size, bound)
        if not _features_bounded(hi, lo, bound):
            return None
        return out, _state_at_reference(S, z, hi, m0)

    def _trains_fused(self, chosen: str, q: Tensor, k: Tensor, v: Tensor, state: Any) -> bool:
        """Whether a bounded causal segment runs as :meth:`_trained_causal`: on numba, float32/float64, with an
        input (the state included) that needs a gradient (without one, the unfused operators or the no-grad fused
        kernel run)."""
        return (chosen == "numba" and q.dtype in (torch.float32, torch.float64) and k.dtype == v.dtype == q.dtype
                and torch.is_grad_enabled()
                and any(t.requires_grad for t in ((q, k, v) if state is None else (q, k, v, *state))))

    def _trained_causal(self, q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, state: Any
                        ) -> tuple[Tensor, Any] | None:
        """The positive map's causal form under autograd on the numba backend, float32/float64: features and
        linear attention as one operator whose backward computes the features' backward on the blocks of its
        products (:mod:`.numba_train`), or None where :meth:`_bounded_causal` would take the log-space form
        (the operator's result is then discarded)."""
        from .numba_train import performer_causal

        bound = BOUNDED_EXPONENT[q.dtype]
        if state is not None and not _state_bounded(state[2], bound):
            return None
        S0, z0, m0 = _state_at_zero(state)
        s = self.get_scale(q) ** 0.5
        out, S, z, hi, lo = performer_causal(q, k, v, self.features.to(q.dtype) * s, s * s, pad, S0, z0,
                                             self.chunk_size)
        if not _features_bounded(hi, lo, bound):
            return None
        return out, _state_at_reference(S, z, hi, m0)

    def _bounded_causal(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: Any,
                        backend: str) -> tuple[Tensor, Any] | None:
        """The positive map's causal form on the linear kernels when every key exponent (and the state's
        reference) lies within ``[-BOUND, BOUND]`` (:data:`BOUNDED_EXPONENT`); else None (the log-space form).

        Then ``phi_k = exp(lk)`` needs no shift (no key feature under- or overflows, and the query's largest
        feature, 1 after its row shift, meets key features >= e^-BOUND: no row can vanish), and the state
        is returned relative to the per-feature key maximum, as the log-space form keeps it. Both forms
        compute the same function; which one runs changes rounding only.
        """
        chosen = runnable_backend(backend, q, k, v)
        # the dtype the linear kernels read the features in: bfloat16 on triton for bfloat16 inputs (v stays half
        # there, see _ops.kernel_inputs); float16 features would only hold exponents within about +-9 (normal
        # numbers span e^-9.7..e^11), so float16 inputs hand the kernels float32 features and float16 values
        half_features = chosen == "triton" and v.dtype == torch.bfloat16
        bound = BOUNDED_EXPONENT.get(v.dtype if half_features else q.dtype)
        if bound is None:
            return None
        pad = padded(kpm)
        if self._trains_fused(chosen, q, k, v, state):
            return self._trained_causal(q, k, v, pad, state)
        if chosen == "numba" and q.dtype in (torch.float32, torch.float64):
            # projection, shift, bounds and exp in one numba pass per tensor, instead of a matmul and seven torch
            # passes (.numba_features)
            from .numba_features import positive_features

            s = self.get_scale(q) ** 0.5
            phi_q, phi_k, hi, lo, _ = positive_features(q, k, self.features.to(q.dtype) * s, s * s, pad)
        else:
            lq, _ = self.log_features(q)
            lk, _ = self.log_features(k)
            with torch.no_grad():
                lk_d = lk.detach()
                hi = (lk_d if pad is None else lk_d.masked_fill(pad, -float("inf"))).amax(dim=2)   # (B, H, M)
                lo = lk_d if pad is None else lk_d.masked_fill(pad, 0.0)
            phi_q = phi_k = None
        with torch.no_grad():
            ok = _features_bounded(hi, lo, bound) and (state is None or _state_bounded(state[2], bound))
        if not ok:
            return None
        if phi_q is None:
            phi_q = torch.exp(lq - lq.detach().amax(-1, keepdim=True))
            phi_k = zero_padded(torch.exp(lk), pad)
        return self._bounded_linear(phi_q, phi_k, v, state, hi, chosen)

    def _bounded_linear(self, phi_q: Tensor, phi_k: Tensor, v: Tensor, state: Any, hi: Tensor,
                        chosen: str) -> tuple[Tensor, Any]:
        """The bounded form's product: linear attention of the unshifted features ``phi_k = exp(lk)`` from
        ``state`` (brought to exponent 0), on ``chosen``'s kernels; the state comes back relative to the
        per-feature key maximum ``max(hi, m)`` (``hi (B, H, M)``, the segment's largest key exponents)."""
        S0, z0, m0 = _state_at_zero(state)
        if not (chosen == "triton" and v.dtype == torch.float16):    # float16: float32 features (above)
            phi_q, phi_k, v = kernel_inputs(chosen, phi_q, phi_k, v)
        out, S, z = backend_module("linear", chosen).linear_attention(phi_q, phi_k, v, S0, z0, causal=True,
                                                                     chunk=self.chunk_size)
        return out, _state_at_reference(S, z, hi, m0)

    def _cp_combine(self, a: Any, b: Any) -> tuple[Tensor, ...]:
        """Two chunks' states: sums for the ``generalized`` map; in log space (``S``, ``z`` relative to the
        per-feature key maximum ``m``) both are brought to the larger maximum before they are added."""
        if not self._log_space:
            return super()._cp_combine(a, b)
        (Sa, za, ma), (Sb, zb, mb) = a, b
        ma, mb = ma.detach(), mb.detach()      # a reference point: the sums do not depend on it
        m = torch.maximum(ma, mb)
        ea, eb = torch.exp(ma - m), torch.exp(mb - m)   # NO_KEY (no key yet) against a real maximum: 0
        return Sa * ea.unsqueeze(-1) + Sb * eb.unsqueeze(-1), za * ea + zb * eb, m

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        if not self._log_space:
            return super()._step_body(q, k, v, state)
        st = self._state_in(state, q, v)
        out, st = self._log_space_causal(q, k, v, None, st, 1)      # chunk 1: the recurrent form
        return out, dict(zip(self.state_keys, st))


# ------------------------------------------------------- the bounded form's state
def _state_bounded(m0: Tensor, bound: float) -> bool:
    """Whether a state's reference ``m0 (B, H, M)`` allows the bounded form: every feature that has seen a key
    within ``[-bound, bound]`` (:data:`NO_KEY`: none seen yet)."""
    m0 = m0.detach()
    return bool(((m0.abs() <= bound) | (m0 <= NO_KEY / 2)).all())


def _features_bounded(hi: Tensor, lo: Tensor, bound: float) -> bool:
    """Whether a segment's key exponents (``hi (B, H, M)`` the largest per feature, ``lo (B, H)`` the smallest
    of each sequence, over its real keys) lie within ``[-bound, bound]``."""
    ok = bool(lo.amin() >= -bound) if lo.numel() else True
    return ok and bool(hi.amax() <= bound) if hi.numel() else ok


def _state_at_zero(state: Any) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(S0, z0, m0)``: a log-space state ``(S, z, m)`` brought to exponent 0 (``S e^m``, ``z e^m``; 0 for a
    feature with no key yet), its reference ``m0`` detached; ``(None, None, None)`` for None."""
    if state is None:
        return None, None, None
    S0r, z0r, m0 = state
    m0 = m0.detach()
    seen = m0 > NO_KEY / 2
    scale = torch.where(seen, torch.exp(torch.where(seen, m0, torch.zeros_like(m0))), torch.zeros_like(m0))
    return S0r * scale.unsqueeze(-1), z0r * scale, m0


def _state_at_reference(S: Tensor, z: Tensor, hi: Tensor, m0: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The state ``(S, z)`` at exponent 0 after a segment brought back to log space: relative to the per-feature
    key maximum ``ref = max(hi, m0)`` (``hi`` the segment's largest key exponents; :data:`NO_KEY` where no key
    has been seen), ``(S e^-ref, z e^-ref, ref)``."""
    ref = hi if m0 is None else torch.maximum(hi, m0)
    seen_end = ref > NO_KEY / 2                                      # a real key seen, in the past or here
    ref = torch.where(seen_end, ref, torch.full_like(ref, NO_KEY))
    back = torch.where(seen_end, torch.exp(-torch.where(seen_end, ref, torch.zeros_like(ref))),
                       torch.zeros_like(ref))
    return S * back.unsqueeze(-1), z * back, ref
