"""``AdaptiveSpanAttention`` (a learned span per head) and ``DynamicSpanAttention`` (a span per query)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import Attention
from attnkit.attention import Limits
from attnkit.caching import may_keep
from attnkit.context import CallContext

from .._checks import MAX_SPAN_LIMIT, positive_int, real
from .._half import Float32Inside
from .band import span_band_attention

__all__ = ["AdaptiveSpanAttention", "DynamicSpanAttention"]

#: keys per score tile of the numba kernels (the query block is ``block_size``): 64-row query blocks with
#: 128-key tiles were the fastest of (32|64|128) x (64|128) at span 64, L = 4K, one thread (benchmarks/)
NUMBA_KEY_TILE = 128


class _SpanAttention(Float32Inside, Attention):
    """Shared by the span mechanisms: options, the band path, the span penalty."""

    refusal_reasons = {"noncausal": "the span mask looks back from each query (Sukhbaatar et al.'s causal "
                                    "language models); pass causal=True"}

    def __init__(self, *, num_heads: int, max_span: int, ramp: float, block_size: int, head_dim: int | None,
                 scale: float | None, backend: str) -> None:
        super().__init__(num_heads=positive_int("num_heads", num_heads), head_dim=head_dim, scale=scale,
                         backend=backend)
        self.max_span = positive_int("max_span", max_span, upper=MAX_SPAN_LIMIT)
        self.ramp = real("ramp", ramp, low=0.0, low_open=True)
        self.block_size = positive_int("block_size", block_size)

    @property
    def limits(self) -> Limits:
        return Limits(max_length=None, equal_length=True)

    def spans_for(self, q: Tensor) -> Tensor:  # pragma: no cover - abstract
        """Spans in positions, ``(B or 1, H, L or 1)``, in the graph."""
        raise NotImplementedError

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        z = self.spans_for(q)
        self.record_aux_loss("span_l1", z.mean())
        z = z.to(q.dtype)   # a module cast to half holds half parameters; the kernels take one dtype
        if ctx.backend == "numba":
            from .numba_band import span_band_attention_numba  # numba is imported only when it runs

            return span_band_attention_numba(q, k, v, z, self.ramp, scale=ctx.scale,
                                             key_padding_mask=ctx.key_padding_mask, block_size=self.block_size,
                                             key_block=max(self.block_size, NUMBA_KEY_TILE))
        return span_band_attention(q, k, v, z, self.ramp, scale=ctx.scale, key_padding_mask=ctx.key_padding_mask,
                                   block_size=self.block_size, z_bound=self.max_span)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_span={self.max_span}, ramp={self.ramp:g}, block_size={self.block_size}"


class AdaptiveSpanAttention(_SpanAttention):
    """Adaptive attention span (Sukhbaatar et al. 2019): causal softmax attention under a learned soft span per head.

    Query ``i`` weights key ``j`` (distance ``x = i - j``) by
    ``m_z(x) = clamp((R + z - x) / R, 0, 1)``: ``a_ij = m_z(x) exp(s_ij) / sum m_z(x') exp(s_ij')``,
    with ``z = max_span · clamp(span_fraction, 0, 1)`` a learned parameter per head (projected back
    into [0, 1] in place at the next forward when an optimizer step moved it out, as the paper does
    after each step: otherwise a span pushed below 0 would never get a gradient again).
    The L1 penalty on the spans is recorded as the auxiliary loss ``span_l1``
    (the mean span over heads, in positions; default weight 2e-6, the
    paper's). Compute follows the spans: on CPU the ``numba`` backend (the
    default there, :mod:`attnkit_adaptive.span.numba_band`) reads for query
    ``i`` only the keys ``i - floor(z + R) .. i`` in fused kernels (online
    softmax, the spans' gradient in the backward), so a head that learned a
    span of 64 costs like a 96-key window; the ``torch`` backend
    (:func:`attnkit_adaptive.span.band.span_band_attention`, any device) reads
    keys back to the largest current ``z + R`` rounded up to a block of
    ``block_size``.

    Shapes: q, k ``(B, H, L, D)``, v ``(B, H, L, E)`` -> ``(B, H, L, E)``; causal
    self-attention only (``causal=True`` required, L == S), with an optional
    key padding mask.

    Args:
        num_heads: H (one span per head).
        max_span: the largest span S, an int in [1, 65536]; spans are ``S · fraction``.
        ramp: R > 0, the width of the soft ramp in positions (paper: 32).
        init_span: the initial span of every head, in [0, max_span] (paper: 0).
        block_size: query and key block of the torch band path (the band is rounded up to it); query
            rows per work item of the numba kernels.
        head_dim: when given, inputs must have this head dimension.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` (numba on CPU when installed, else torch), ``"numba"`` (CPU fused kernels) or
            ``"torch"`` (the band path, any device).

    Raises:
        InvalidInputError: ``max_span`` below 1 or above 65536, ``ramp`` not positive,
            ``init_span`` outside [0, max_span], ``num_heads`` or ``block_size`` not a positive int.
    """

    def __init__(self, *, num_heads: int, max_span: int = 1024, ramp: float = 32.0, init_span: float = 0.0,
                 block_size: int = 64, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, max_span=max_span, ramp=ramp, block_size=block_size,
                         head_dim=head_dim, scale=scale, backend=backend)
        init = real("init_span", init_span, low=0.0, high=float(self.max_span))
        self.span_fraction = nn.Parameter(torch.full((self.num_heads,), init / self.max_span))

    @property
    def spans(self) -> Tensor:
        """The current span of each head in positions, ``(H,)`` (detached)."""
        return (self.span_fraction.detach().clamp(0.0, 1.0) * self.max_span)

    def lab_stats(self) -> dict[str, Any]:
        """For ``attnkit train``: the learned span of each head, in positions."""
        return {"spans": [round(float(z), 1) for z in self.spans]}

    def project_(self) -> None:
        """Put ``span_fraction`` back into [0, 1] in place when an optimizer step moved it out.

        As the paper's ``clamp_param`` after each step: a fraction left below 0 would get no gradient
        through the clamp (the span would stay 0 for good); projected to 0 it gets one again (the clamp
        passes gradients at its bounds). Called at the start of every forward; a no-op (no version
        bump, so repeated forwards in one graph, as inside an ACT block, are safe) when in range.
        """
        p = self.span_fraction
        if torch.compiler.is_exporting():
            return   # an exported program is not trained (and a branch on parameter values cannot be exported)
        with torch.no_grad():
            if bool(((p < 0) | (p > 1)).any()):
                p.clamp_(0.0, 1.0)

    def spans_for(self, q: Tensor) -> Tensor:
        """``(1, H, 1)`` spans in positions, in the graph (the gradient reaches ``span_fraction``)."""
        self.project_()
        z = self.span_fraction.clamp(0.0, 1.0) * self.max_span
        return z.to(q.dtype).view(1, -1, 1)


class DynamicSpanAttention(_SpanAttention):
    """Dynamic attention span (Sukhbaatar et al. 2019, sec. 3.2): the span predicted per query token.

    ``z_t = S · sigmoid(w_h · x_t + b_h)`` per head ``h`` and query position
    ``t``, where **x_t is the query vector** ``q[b, h, t]`` (the head's
    projected query: an attention module sees no layer input; the paper uses the
    layer's input ``x_t``), with ``w_h`` ``(D,)`` and ``b_h`` learned. The soft
    mask, the backends and the ``span_l1`` penalty (the mean predicted span)
    are those of ``adaptive-span``; the numba kernels take the span per query,
    so each query reads only the keys its own span reaches (the torch band path
    reads up to the largest span in the batch).

    Shapes: q, k ``(B, H, L, D)``, v ``(B, H, L, E)`` -> ``(B, H, L, E)``; causal
    self-attention only, optional key padding mask.

    Args:
        num_heads: H.
        head_dim: D (the predictor's input size).
        max_span: S, an int in [1, 65536].
        ramp: R > 0.
        init_span: the initial span (w = 0, b = logit(init_span / S)), in [0, max_span].
        block_size: query and key block of the torch band path; query rows per work item of the numba kernels.
        scale: multiplier of ``q·k``; None means ``1/sqrt(D)``.
        backend: ``"auto"`` (numba on CPU when installed, else torch), ``"numba"`` or ``"torch"``.

    Raises:
        InvalidInputError: ``max_span`` below 1 or above 65536, ``ramp`` not positive,
            ``init_span`` outside [0, max_span], ``num_heads``, ``head_dim`` or ``block_size`` not a positive int.
    """

    def __init__(self, *, num_heads: int, head_dim: int, max_span: int = 1024, ramp: float = 32.0,
                 init_span: float = 64.0, block_size: int = 64, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, max_span=max_span, ramp=ramp, block_size=block_size,
                         head_dim=positive_int("head_dim", head_dim), scale=scale, backend=backend)
        init = real("init_span", init_span, low=0.0, high=float(self.max_span))
        frac = min(max(init / self.max_span, 1e-4), 1 - 1e-4)
        self.span_weight = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
        self.span_bias = nn.Parameter(torch.full((self.num_heads,), math.log(frac / (1 - frac))))
        self._last_spans: Tensor | None = None

    def spans_for(self, q: Tensor) -> Tensor:
        """``(B, H, L)`` spans ``S · sigmoid(w_h · q_t + b_h)``, in the graph."""
        logits = torch.einsum("bhld,hd->bhl", q, self.span_weight.to(q.dtype)) + self.span_bias.to(q.dtype)[:, None]
        z = self.max_span * torch.sigmoid(logits)
        if may_keep() and not torch.compiler.is_exporting():   # never a transform's wrapper nor a traced tensor
            self._last_spans = z.detach().mean(dim=(0, 2))
        return z

    @property
    def spans(self) -> Tensor | None:
        """The mean predicted span of each head at the last forward, ``(H,)``, or None before any."""
        return self._last_spans

    def lab_stats(self) -> dict[str, Any]:
        """For ``attnkit train``: the mean predicted span of each head at the last forward."""
        return {} if self._last_spans is None else {"mean_spans": [round(float(z), 1) for z in self._last_spans]}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state = dict(state)
        state["_last_spans"] = None
        return state
