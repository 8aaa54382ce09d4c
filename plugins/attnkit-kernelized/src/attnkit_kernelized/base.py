"""What the four kernelized attentions share: options, masking of features, the causal segment loop, states."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit import Attention
from attnkit.context import CallContext
from attnkit.errors import InvalidInputError
from attnkit.transforms import symbolic

from ._busy import backward_span, busy_threads, start_backward_span
from ._ops import HALF_DTYPES, backend_module, kernel_inputs, runnable_backend
from .linear.recurrent import linear_attention_step
from .options import check_choice, check_int


class KernelizedAttention(Attention):
    """Base of the kernelized attentions (contract 2: :meth:`_attend`).

    A subclass provides :meth:`feature_pair` (``phi(q)``, ``phi(k)`` with the
    features of padded keys set to 0: ``phi(0)`` is not 0, and the base class
    zeroes only keys and values), :meth:`feature_count` and
    :meth:`_causal_segment` / :meth:`_step` for its recurrence; the non-causal
    form is linear attention (``linear`` backends). Causal calls run segment
    by segment (:attr:`segment_length` positions), carrying the state across
    segments, so the features of one segment exist at a time; the same loop
    serves ``forward(..., state=..., return_state=True)``.

    States are dicts of tensors (``{"S": (B, H, M, E), "z": (B, H, M)}`` for
    linear attention); a fresh state holds None (zeros, sized by the first
    positions, since the value dimension E is known only then).
    """

    #: ranges and choices checked by attnkit.build before the module is built (the constructor checks again)
    option_constraints = {"chunk_size": {"minimum": 1}}

    refusal_reasons = {
        "attn_mask": ("a kernelized attention sums phi(k) v^T over keys before any query sees them, so it can "
                      "only drop whole keys (pass key_padding_mask, bool (B, S)) and the future (causal=True)"),
    }

    #: positions per segment of the causal forms (features are computed for one segment at a time)
    segment_length: ClassVar[int] = 2048
    #: positions per segment on CUDA (lower it to bound the memory of long causal calls): each segment costs a
    #: round of small launches, and 2,048 positions leave most of a GPU idle. GPU run 6 (an H200, bfloat16,
    #: B = 1, H = 8, docs/benchmarks.md): one segment instead of 2,048-position ones made performer, rfa and
    #: fast-weight 3.9-7.7x faster forward and 4.1-5.7x forward+backward at L = 16,384, performer 11x / 9.1x at
    #: 65,536, at about twice the peak memory (1.2-1.3 against 0.6 GiB at 16K)
    cuda_segment_length: ClassVar[int] = 65536
    #: names of the state's tensors
    state_keys: ClassVar[tuple[str, ...]] = ("S", "z")
    #: constant buffers (random projections) kept in float32 when the module is cast to float16/bfloat16
    float32_buffers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, num_heads: int | None, head_dim: int | None, scale: float | None, backend: str,
                 chunk_size: int, needs_heads: bool = False, needs_head_dim: bool = True) -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        offered = type(self).capabilities.backends
        check_choice("backend", backend, ("auto", *offered))
        name = type(self).__name__
        if needs_head_dim and head_dim is None:
            raise InvalidInputError(f"{name}: head_dim: expected the head dimension D (an int >= 1) that features "
                                    "and parameters are drawn for, got None")
        if needs_heads and num_heads is None:
            raise InvalidInputError(f"{name}: num_heads: expected the number of heads H (an int >= 1; its "
                                    "parameters are per head), got None")
        self.chunk_size = check_int("chunk_size", chunk_size)

    # ------------------------------------------------------------------ hooks
    def feature_pair(self, q: Tensor, k: Tensor, *, causal: bool,
                     key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(phi(q) (B, H, L, M), phi(k) (B, H, S, M))``; ``phi(k)`` is 0 at padded keys."""
        raise NotImplementedError

    def feature_count(self, head_dim: int) -> int:
        """M, the number of features per head for inputs of head dimension ``head_dim``."""
        raise NotImplementedError

    @property
    def feature_dim(self) -> int:
        """M for the built ``head_dim``."""
        if self.head_dim is None:
            raise InvalidInputError(f"{self.impl_name!r}: feature_dim depends on head_dim, which was not given")
        return self.feature_count(self.head_dim)

    def _causal_segment(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: tuple[Tensor, ...] | None,
                        backend: str) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Causal attention of one segment from ``state`` (None: zeros); ``(out, new_state)``."""
        phi_q, phi_k = self._segment_features(q, k, kpm, runnable_backend(backend, q, k, v))
        backend = runnable_backend(backend, phi_q, phi_k, v)
        S0, z0 = (None, None) if state is None else state
        phi_q, phi_k, v = kernel_inputs(backend, phi_q, phi_k, v)
        out, S, z = backend_module("linear", backend).linear_attention(phi_q, phi_k, v, S0, z0, causal=True,
                                                                      chunk=self.chunk_size)
        return out, (S, z)

    def _segment_features(self, q: Tensor, k: Tensor, kpm: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
        """The causal segment's features for ``backend``: :meth:`feature_pair` (a mechanism may compute the same
        features another way for one backend, as ``linear`` does for numba)."""
        return self.feature_pair(q, k, causal=True, key_padding_mask=kpm)

    def _before_forward(self) -> None:
        """Called once per forward call (performer redraws its features here)."""

    # ---------------------------------------------------------------- forward
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Any:
        # a CPU call on a machine other processes keep busy runs torch on one thread (see ._busy), and so does
        # its backward (the span from the outputs' nodes to the inputs')
        with busy_threads(q.device):
            (q, k, v), span = backward_span(q, k, v)
            res = self._attend_dtypes(q, k, v, ctx)
            start_backward_span(span, res)
            return res

    def _attend_dtypes(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Any:
        if q.dtype not in HALF_DTYPES:
            return self._attend_body(q, k, v, ctx)
        # half precision: features, states and normalisers in float32, the output cast back to the input
        # dtype. On triton v stays half: _ops.kernel_inputs hands the kernels half features and values
        # (float32 accumulators and states); every other backend gets v in float32 there
        res = self._attend_body(q.float(), k.float(), v if ctx.backend == "triton" else v.float(), ctx)
        if isinstance(res, tuple):
            return res[0].to(q.dtype), res[1]
        return res.to(q.dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``.to()``, ``.half()``, ``.cuda()``, ...) keeping :attr:`float32_buffers` in float32
        where the cast would make them float16/bfloat16 (random projections lose their precision there;
        parameters follow the cast, and are upcast per call with the inputs)."""
        keep = {name: self._buffers[name] for name in self.float32_buffers if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            new = self._buffers[name]
            if new is not None and new.dtype in HALF_DTYPES:
                self._buffers[name] = old.to(device=new.device, dtype=torch.float32)
        return self

    def _attend_body(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Any:
        self._before_forward()
        # the kernels read contiguous rows; a multi-head layer hands over transposed views. Copying them
        # once here (D wide, before the M-wide features) also keeps every stride the same under
        # torch.compile's fake tensors as at run time (elementwise backward ops on mixed layouts differ)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kpm = ctx.key_padding_mask
        if not ctx.causal:  # linear attention on every backend (fast-weight is causal only: refused before)
            phi_q, phi_k = self.feature_pair(q, k, causal=False, key_padding_mask=kpm)
            # two matmuls are as fast as the numba full-product kernel on CPU (measured 6.5-23 ms against
            # 9-36 ms at M=E=64): automatic dispatch takes them; a forced backend runs its own kernel
            chosen = ctx.backend if (self.backend != "auto" or ctx.backend != "numba") else "torch"
            backend = runnable_backend(chosen, phi_q, phi_k, v)
            phi_q, phi_k, v = kernel_inputs(backend, phi_q, phi_k, v)
            out, _, _ = backend_module("linear", backend).linear_attention(phi_q, phi_k, v, causal=False,
                                                                          chunk=self.chunk_size)
            return out
        state = self._state_in(ctx.state, q, v) if ctx.return_state else None
        out, state = self._segments(q, k, v, kpm, state, ctx.backend)
        return (out, dict(zip(self.state_keys, state))) if ctx.return_state else out

    def segment_length_for(self, device: torch.device) -> int:
        """Positions per causal segment for inputs on ``device``: :attr:`cuda_segment_length` on CUDA,
        :attr:`segment_length` elsewhere."""
        return self.cuda_segment_length if device.type == "cuda" else self.segment_length

    def _segments(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, state: tuple[Tensor, ...] | None,
                  backend: str, seg: int | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The causal form over ``L`` positions from ``state`` (None: zeros), ``seg`` positions at a time (None:
        :meth:`segment_length_for` the inputs' device)."""
        L = q.shape[2]
        seg = self.segment_length_for(q.device) if seg is None else seg
        if symbolic(L) or L <= seg:  # a dynamic length in torch.export (one segment of any length), or one segment:
            # no split (a split into one part still costs its backward a concatenation: a copy of each gradient)
            return self._causal_segment(q, k, v, kpm, state, backend)
        outs = []
        # torch.split, not slicing: under autograd one backward node per input concatenates the segments'
        # gradients, where a slice per segment writes a zero tensor of the whole length and adds them up
        qs, ks, vs = (t.split(seg, dim=2) for t in (q, k, v))
        for i, s0 in enumerate(range(0, L, seg)):
            part = None if kpm is None else kpm[:, s0:s0 + seg]
            out, state = self._causal_segment(qs[i], ks[i], vs[i], part, state, backend)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out, state  # type: ignore[return-value]

    # ------------------------------------------------------ context parallelism
    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, cp: Any) -> Tensor:
        """The causal form split along L (:func:`attnkit.context_parallel.context_parallel`).

        Each rank computes the summary of its chunk from a zero state (:meth:`_cp_summary`), the
        summaries are all-gathered (differentiably), each rank folds those of the ranks before it
        (:meth:`_cp_combine`: an exclusive prefix over ranks) into the state its first position
        would have had on one process, then runs its chunk from that state. The summaries cost
        one more pass over the chunk (linear attention's is two sums).
        """
        if q.dtype in HALF_DTYPES:          # as _attend: float32 inside, the output in the input dtype
            return self._context_parallel(q.float(), k.float(), v.float(), cp).to(q.dtype)
        self._before_forward()
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kpm = cp.key_padding_mask
        backend = self.resolve_backend(q, k, v)
        summary = self._cp_summary(q, k, v, kpm, backend)
        prefix = cp.exclusive_prefix(cp.gather(list(summary)), self._cp_combine)
        state = None if prefix is None else tuple(prefix[:len(self.state_keys)])
        out, _ = self._segments(q, k, v, kpm, state, backend)
        return out

    def _cp_summary(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, backend: str
                    ) -> tuple[Tensor, ...]:
        """What this chunk does to the state: by default the state after it from zeros (additive states)."""
        _, state = self._segments(q, k, v, kpm, None, backend)
        return tuple(state)

    def _cp_combine(self, a: Any, b: Any) -> tuple[Tensor, ...]:
        """The summary of ``a``'s positions followed by ``b``'s; additive by default (``S``, ``z`` are sums)."""
        return tuple(x + y for x, y in zip(a, b))

    # --------------------------------------------------------------- streaming
    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> Any:
        return dict.fromkeys(self.state_keys)

    def _state_shapes(self, B: int, H: int, M: int, E: int) -> dict[str, tuple[int, ...]]:
        return {"S": (B, H, M, E), "z": (B, H, M)}

    def _state_in(self, data: Any, q: Tensor, v: Tensor) -> tuple[Tensor, ...] | None:
        """The state's tensors, checked against this call's shapes; None for a fresh state."""
        if not isinstance(data, dict) or set(data) != set(self.state_keys):
            raise InvalidInputError(
                f"state: expected the data of a state of {self.impl_name!r} (a dict with {list(self.state_keys)}), "
                f"got {type(data).__name__}")
        if all(data[key] is None for key in self.state_keys):
            return None
        B, H, _, D = q.shape
        want = self._state_shapes(B, H, self.feature_count(D), v.shape[-1])
        for key in self.state_keys:
            t = data[key]
            if not isinstance(t, Tensor) or tuple(t.shape) != want[key]:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise InvalidInputError(
                    f"state: {key} of shape {want[key]} expected for q {tuple(q.shape)} and v {tuple(v.shape)} "
                    f"(B, H, M={self.feature_count(D)} features, E), got {got}; a state serves the head count "
                    "and value size it started with")
        return tuple(data[key] for key in self.state_keys)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        """``step()``: :meth:`_step_body`; half-precision inputs run it in float32 (the state stays float32),
        the output in the input dtype."""
        if q.dtype not in HALF_DTYPES:
            return self._step_body(q, k, v, state)
        out, state = self._step_body(q.float(), k.float(), v.float(), state)
        return out.to(q.dtype), state

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        """The recurrent form (one position at a time) from the state, on any device."""
        S, z = self._state_in(state, q, v) or self._zero_state(q, v)
        phi_q, phi_k = self.feature_pair(q, k, causal=True)
        out, S, z = linear_attention_step(phi_q, phi_k, v, S, z)
        return out, {"S": S, "z": z}

    def _zero_state(self, q: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        B, H, _, D = q.shape
        shapes = self._state_shapes(B, H, self.feature_count(D), v.shape[-1])
        return tuple(q.new_zeros(shapes[key]) for key in self.state_keys)
