"""What every sparse pattern shares: the module base class, option checks, dispatch to the engine, streaming.

A pattern is an :class:`attnkit.masks.Mask` (``pattern_mask(L, S, causal=...)``);
``forward`` runs ``pattern & <the caller's mask>`` on the block-sparse engine
(:func:`attnkit_sparse.engine.attend`), so causal, key padding, documents,
windows, mask functions, unions and bool tensors compose with every pattern
and only the attended tiles are computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit import Attention
from attnkit.caching import cached, may_keep
from attnkit.context import CallContext
from attnkit.errors import InvalidInputError
from attnkit.masks import Mask
from attnkit.masks import causal as causal_mask
from attnkit.positions import Positions

__all__ = ["SparsePatternAttention", "check_int", "check_bool", "check_positions", "check_grid",
           "CAUSAL_PATTERNS", "STREAMING_PATTERNS"]

#: the registered patterns that have a causal form (named in the refusal of those that do not)
CAUSAL_PATTERNS = ("local", "dilated", "block-local", "global", "random", "longformer", "strided", "fixed",
                   "local-2d", "axial", "bp-transformer", "block-sparse")
#: the patterns that stream exactly (their causal forms)
STREAMING_PATTERNS = ("local", "dilated", "strided", "fixed")


def spread_evenly(n: int, threads: int | None = None) -> bool:
    """Whether ``n`` work items (the ``B·H`` sequences) spread evenly over ``threads`` (None: the kernels' thread
    count, :func:`attnkit.numba_pool.kernel_threads`): ``n % threads == 0`` or ``n >= 4·threads``. Then one item
    per sequence keeps every thread busy, and the CPU paths take their per-sequence kernels."""
    if threads is None:
        from attnkit.numba_pool import kernel_threads
        threads = kernel_threads()
    return n % threads == 0 or n >= 4 * threads


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` when it is an int >= ``minimum`` (not a bool), else InvalidInputError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidInputError(f"{name}: expected True or False, got {value!r}")
    return value


def check_positions(name: str, value: Any) -> tuple[int, ...]:
    """A sequence of distinct ints >= 0 (sorted), else InvalidInputError naming ``name``."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidInputError(f"{name}: expected a list of distinct positions (ints >= 0), got {value!r}")
    out = []
    for p in value:
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise InvalidInputError(f"{name}: expected positions that are ints >= 0, got {p!r} in {list(value)!r}")
        out.append(int(p))
    dup = sorted({p for p in out if out.count(p) > 1})
    if dup:
        raise InvalidInputError(f"{name}: expected distinct positions, got {dup} more than once in {list(value)!r}")
    if not out:
        raise InvalidInputError(f"{name}: expected at least one position, got an empty list")
    return tuple(sorted(out))


def content_backend_order(backends: tuple[str, ...], device: torch.device, dtype: torch.dtype,
                          block: int | None) -> tuple[str, ...]:
    """``auto``'s order for the content-based modules (lsh, routing, sinkhorn): ``triton`` first for float16 and
    bfloat16 inputs on CUDA when the attention block (``block``: lsh's bucket, sinkhorn's block; None for routing,
    which tiles its clusters itself) is a power of two from 16 to 128; the declared order (numba, torch, triton)
    otherwise.

    Measured on an H100 in bfloat16 at L = 16,384 (docs/benchmarks.md, "GPU run 4"): triton against torch 1.8x /
    2.0x (lsh), 2.0x / 2.9x (routing), 1.2x / 1.2x (sinkhorn), forward / forward+backward. float32 stays on torch:
    the engine's triton backward is slow there (IEEE products); GPU run 5 measured the content-based triton path in
    float32 at 1.15-1.18x torch forward and 1.95-7.8x slower forward+backward.
    """
    fits = block is None or (16 <= block <= 128 and block & (block - 1) == 0)
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and fits and "triton" in backends:
        return ("triton", *(b for b in backends if b != "triton"))
    return tuple(backends)


def check_grid(name: str, value: Any) -> tuple[int, int] | int | None:
    """None, an int (columns per row) or a pair (rows, cols) of ints >= 1."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return check_int(name, value)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return check_int(f"{name}[0] (rows)", value[0]), check_int(f"{name}[1] (cols)", value[1])
    raise InvalidInputError(f"{name}: expected None, an int (positions per row) or a pair (rows, cols) of ints "
                            f">= 1, got {value!r}")


class SparsePatternAttention(Attention):
    """Softmax attention restricted to a position-based pattern, on the block-sparse engine.

    Subclasses implement :meth:`_pattern` (the pattern as a mask object, for
    the causal or the bidirectional form); streaming ones also set
    :attr:`streams` and implement :meth:`_still_visible`.
    """

    option_constraints: ClassVar[dict[str, dict[str, Any]]] = {
        "backend": {"choices": ("auto", "numba", "flex", "triton", "torch")},
    }

    #: the pattern has a causal form
    has_causal_form: ClassVar[bool] = True
    #: the causal form streams exactly (``step`` / ``forward(state=...)``)
    streams: ClassVar[bool] = False

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        offered = ("auto", "numba", "flex", "triton", "torch")
        if backend not in offered:
            raise InvalidInputError(f"backend: expected one of {list(offered)}, got {backend!r}")
        self._patterns: dict[bool, Mask | None] = {}
        self._combined: dict[tuple[Any, ...], tuple[tuple[Mask, ...], Mask | None]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # pattern masks (and their block indices) are a cache: a copy or a pickle rebuilds them, so a
        # third party's mask function (a lambda, a local function) never has to pickle
        state = dict(super().__getstate__())
        state["_patterns"], state["_combined"] = {}, {}
        state.pop("_causal", None)
        return state

    def backend_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """``auto``'s order: the declared one (triton, flex, numba, torch), except float32 on CUDA, which tries
        ``flex`` before ``triton``.

        Measured on an H100 (docs/benchmarks.md, "GPU, second session"): in bfloat16 the engine's triton
        kernels beat the flex backend, but in float32 (IEEE products, no tensor cores) their backward was
        4-7x slower than the flex backend's (local at 16K: 32.9 against 7.8 ms forward+backward).
        """
        order = tuple(self.caps.backends)
        if device.type == "cuda" and dtype == torch.float32 and "flex" in order:
            order = ("flex", *(b for b in order if b != "flex"))
        return order

    # ------------------------------------------------------------- the pattern
    def _pattern(self, causal: bool) -> Mask | None:
        """The pattern's allowed (query, key) pairs as a mask (None: every pair, block-sparse's case)."""
        raise NotImplementedError

    def pattern_mask(self, L: int, S: int, *, causal: bool = False) -> Mask | None:
        """The pattern as an :class:`attnkit.masks.Mask` (the causal form includes the causal constraint).

        One object per form, kept on the module, so its block indices are
        computed once per shape. ``L`` and ``S`` are checked against the
        pattern's own length rules (grid shapes, global positions).

        Raises:
            UnsupportedFeatureError: ``causal=True`` for a pattern without a causal form.
            InvalidInputError: lengths the pattern's options do not fit.
        """
        if causal and not self.has_causal_form:
            self._refuse("causal=True", "it has no causal form", causal=True)
        self._check_lengths(L, S)
        # options only, built once: never a fake tensor (torch.export), an inference tensor or a torch.func
        # transform's wrapper (attnkit.caching.cached)
        return cached(self._patterns, causal, lambda: self._pattern(causal))

    def _check_lengths(self, L: int, S: int) -> None:
        """Raise InvalidInputError when the options do not fit these lengths (default: any)."""

    def state_owner(self) -> tuple[str, str]:
        """The base's owner, with the pattern's options (a state never crosses to another window or stride)."""
        name, conf = super().state_owner()
        return name, f"{conf}; {self.extra_repr()}"

    # ---------------------------------------------------------------- forward
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Any:
        from .engine import attend, reference_attend

        L, S = q.shape[2], k.shape[2]
        if ctx.return_state:
            return self._stream(q, k, v, ctx)
        mask = self._engine_mask(self.pattern_mask(L, S, causal=ctx.causal), ctx.mask)
        if mask is not None and mask.has_bias:
            # an additive float attn_mask is a dense (L, S) input: exact, on the dense masked softmax
            return reference_attend(q, k, v, mask, scale=ctx.scale, positions=ctx.positions)
        return attend(q, k, v, mask, scale=ctx.scale, backend=ctx.backend, positions=ctx.positions)

    def _engine_mask(self, pattern: Mask | None, mask: Mask | None) -> Mask | None:
        """``pattern & mask``, the same object for the same parts, so the engine's cached plan is reused.

        ``forward`` makes a new causal mask on every call; a pattern's causal form already holds the causal
        constraint, so causal parts are dropped (or, with no pattern, replaced by one kept on the module).
        The other parts (the caller's mask objects) are matched by identity; masks that change with
        every batch (key padding, documents) are not kept.
        """
        if mask is None:
            return pattern
        parts = mask.conjuncts()
        has_causal = any(p.kind == "causal" for p in parts)
        rest = tuple(p for p in parts if p.kind != "causal")
        key = (id(pattern), has_causal, *(id(p) for p in rest))
        hit = self._combined.get(key)
        if hit is not None and len(hit[0]) == len(rest) and all(a is b for a, b in zip(hit[0], rest)):
            return hit[1]
        if has_causal and pattern is None:
            self.__dict__.setdefault("_causal", causal_mask())
        head = [pattern] if pattern is not None else ([self._causal] if has_causal else [])
        out: Mask | None = None
        for p in [*head, *rest]:
            out = p if out is None else out & p
        if any(p.batch_dependent for p in rest):
            return out  # key padding and documents change with every batch: not worth keeping their plans
        if not may_keep():
            return out  # (under a torch.func transform: its pattern may hold the transform's wrappers)
        if len(self._combined) > 8:
            self._combined.clear()
        self._combined[key] = (rest, out)  # holds the parts: their ids cannot be reused while cached
        return out

    # -------------------------------------------------------------- streaming
    def _still_visible(self, kpos: Tensor, next_pos: int) -> Tensor:
        """Bool like ``kpos``: keys some query at a position >= ``next_pos`` may still see."""
        raise NotImplementedError

    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> Any:
        return {"k": None, "v": None, "pos": None, "next": 0}

    def _state_in(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict) or set(data) != {"k", "v", "pos", "next"}:
            raise InvalidInputError(
                f"state: expected the data of a state of {self.impl_name!r} (a dict with k, v, pos, next), "
                f"got {type(data).__name__}")
        return data

    def _stream(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> tuple[Tensor, Any]:
        rest = ctx.rest("causal")
        if rest is not None:
            raise InvalidInputError(
                f"forward: with state= or return_state=True, {self.impl_name!r} takes causal=True only (the state "
                f"holds the keys future positions can see); got the extra mask {rest!r}")
        if ctx.positions is not None:
            raise InvalidInputError(
                f"forward: with state=, positions come from the state (it counts the positions consumed); "
                f"got positions={ctx.positions!r}")
        return self._advance(q, k, v, ctx.state, ctx.backend)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        return self._advance(q, k, v, state, self.resolve_backend(q, k, v))

    def _advance(self, q: Tensor, k: Tensor, v: Tensor, data: Any, backend: str) -> tuple[Tensor, Any]:
        """Attend a chunk of T new positions from the state; keep only the keys later queries can see."""
        from .engine import attend

        data = self._state_in(data)
        T, start = q.shape[2], int(data["next"])
        qpos = torch.arange(start, start + T, device=q.device)
        if data["k"] is None:
            K, V, kpos = k, v, qpos
        else:
            K, V = torch.cat([data["k"], k], dim=2), torch.cat([data["v"], v], dim=2)
            kpos = torch.cat([data["pos"], qpos])
        pat = self.pattern_mask(T, K.shape[2], causal=True)
        mask = pat & causal_mask()
        out = attend(q, K, V, mask, scale=self.get_scale(q), backend=backend, positions=Positions(q=qpos, k=kpos))
        keep = self._still_visible(kpos, start + T)
        if not bool(keep.all()):
            idx = keep.nonzero().view(-1)
            K, V, kpos = K.index_select(2, idx), V.index_select(2, idx), kpos[idx]
        return out, {"k": K, "v": V, "pos": kpos, "next": start + T}

    def state_size(self, state: Any) -> int:
        """Keys held by a state (an :class:`attnkit.AttentionState` or its data)."""
        data = getattr(state, "data", state)
        return 0 if data["k"] is None else int(data["k"].shape[2])
