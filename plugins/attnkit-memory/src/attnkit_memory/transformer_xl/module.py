"""``transformer-xl``: segment recurrence over cached keys/values with relative positional attention.

Dai, Yang, Yang, Carbonell, Le, Salakhutdinov (2019), arXiv:1901.02860.

One call attends from ``L`` queries to the ``M`` cached memory keys followed
by its own ``S`` keys (``T = M + S``), causally, with the score of query
``i`` and key ``j`` at relative distance ``d = T - L + i - j >= 0``::

    score = scale * [ q_i·k_j + u·k_j + q_i·(W_r R_d) + v·(W_r R_d) ]
            (content-content, global content bias u, content-position, global position bias v)

``R_d`` is the sinusoidal encoding of ``d`` and ``W_r`` a learned per-head
projection. The position terms are computed for the ``T`` distances once and
moved into place with the relative shift (:func:`attnkit_memory.common.rel_shift`):
at most ``L x T`` scores are materialised.

The state (``"segment"`` streaming): the last ``mem_len`` keys and values
seen, with their padding. Each ``forward(..., state=s, return_state=True)``
or ``step`` is one segment; the new memory is the last ``mem_len`` positions
of ``memory + segment``. The memory is detached from the autograd graph
(truncated backpropagation, as in the paper) unless ``grad_segments=N > 0``:
then the keys/values of the last N segments stay in the graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import Attention
from attnkit.attention import Limits
from attnkit.caching import kept_tensors
from attnkit.errors import InvalidInputError, UnsupportedFeatureError
from attnkit.transforms import symbolic

from ..common import Float32Inside, causal_keep, check_int_option, masked_softmax, rel_shift, sinusoid

__all__ = ["TransformerXLAttention"]


class TransformerXLAttention(Float32Inside, Attention):
    """Transformer-XL attention: relative positions (four terms) over a segment memory of keys and values.

    Args:
        num_heads: heads H (required: u, v and W_r are per head).
        head_dim: head dimension D (required).
        mem_len: memory length M >= 1: positions kept from previous segments.
        grad_segments: keep the memory of the last N segments in the autograd
            graph (0: detached between segments, as in the paper).
        rel_dim: width of the sinusoidal relative encodings (even); None: H*D
            (the model width, as in the paper).
        max_distance: longest attention span ``M + S`` accepted (the length of
            the relative-position table); None: no limit (encodings are
            computed for the distances of each call).
        scale: multiplier of the scores; None: 1/sqrt(D).
        backend: ``"auto"`` (``"sdpa"``), ``"sdpa"`` (fused scaled_dot_product_attention with the
            position terms as its additive mask) or ``"torch"`` (the readable path: explicit scores,
            masked softmax).

    Shapes: ``q`` ``(B, H, L, D)``, ``k`` ``(B, H, S, D)``, ``v`` ``(B, H, S, E)``
    -> ``(B, H, L, E)``. Causal only (``causal=True``); ``L <= S`` or ``L > S``
    both bottom-right aligned over memory + keys.

    Raises:
        InvalidInputError: a missing ``num_heads``/``head_dim``, ``mem_len`` < 1,
            ``grad_segments`` < 0, an odd ``rel_dim``, ``max_distance`` < 1; in
            forward, a state from another module, batch, dtype, device or
            configuration, or whose values have another E.
        UnsupportedFeatureError: ``M + S`` beyond ``max_distance``.
    """

    option_constraints = {
        "mem_len": {"minimum": 1},
        "grad_segments": {"minimum": 0},
        "rel_dim": {"minimum": 2},
        "max_distance": {"minimum": 1},
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, mem_len: int = 64,
                 grad_segments: int = 0, rel_dim: int | None = None, max_distance: int | None = None,
                 scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        if num_heads is None or head_dim is None:
            raise InvalidInputError(
                f"{type(self).__name__}: num_heads and head_dim are required (u, v and W_r are per-head "
                f"parameters), got num_heads={num_heads!r}, head_dim={head_dim!r}")
        check_int_option("mem_len", mem_len, 1)
        check_int_option("grad_segments", grad_segments, 0)
        check_int_option("max_distance", max_distance, 1, allow_none=True)
        if rel_dim is None:
            rel_dim = num_heads * head_dim + (num_heads * head_dim) % 2
        check_int_option("rel_dim", rel_dim, 2)
        if rel_dim % 2:
            raise InvalidInputError(f"rel_dim: expected an even int (sin and cos halves), got {rel_dim}")
        self.mem_len, self.grad_segments = mem_len, grad_segments
        self.rel_dim, self.max_distance = rel_dim, max_distance
        self.u = nn.Parameter(torch.randn(num_heads, head_dim) * 0.02)        # global content bias
        self.v_bias = nn.Parameter(torch.randn(num_heads, head_dim) * 0.02)   # global position bias
        self.r_proj = nn.Linear(rel_dim, num_heads * head_dim, bias=False)  # W_{k,R}

    # ------------------------------------------------------------ options
    def _option_fingerprint(self) -> str:
        return (f"mem_len={self.mem_len}; grad_segments={self.grad_segments}; rel_dim={self.rel_dim}; "
                f"max_distance={self.max_distance}")

    def state_owner(self) -> tuple[str, str]:
        name, conf = super().state_owner()
        return name, f"{conf}; {self._option_fingerprint()}"

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._option_fingerprint().replace('; ', ', ')}"

    @property
    def limits(self) -> Limits:
        c = self.caps
        return Limits(max_length=self.max_distance, equal_length=not (c.cross or c.causal_cross),
                      length_multiple=c.length_multiple)

    # ------------------------------------------------------------ pieces
    def rel_encodings(self, T: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``W_r R_d`` for ``d = T-1, ..., 0`` (column order of the shift), as ``(H, T, D)``.

        Without autograd (evaluation, ``step``) the projected table is cached and reused while
        ``W_r`` is unchanged (its storage and version counter), so a segment does not re-project
        ``T`` encodings; under autograd it is recomputed (``W_r`` gets its gradient).
        """
        w = self.r_proj.weight
        cacheable = not (torch.is_grad_enabled() and w.requires_grad) and not torch.compiler.is_compiling()
        key = (T, dtype, device, w.data_ptr(), w._version) if cacheable else None
        if cacheable:
            hit = self.__dict__.get("_rel_cache")
            if hit is not None and hit[0] == key:
                return hit[1]
        # cached: never an inference tensor a later call under autograd (frozen W_r) would meet; a no-op
        # outside inference mode
        with kept_tensors():
            d = torch.arange(T - 1, -1, -1, device=device)
            # W_r in the computing dtype (a bfloat16 module called on upcast inputs: float32; its gradient comes
            # back in the parameter's dtype)
            r = nn.functional.linear(sinusoid(d, self.rel_dim, dtype), w.to(dtype))  # (T, H*D)
            out = r.view(T, self.num_heads, self.head_dim).transpose(0, 1)
        if cacheable:
            self.__dict__["_rel_cache"] = (key, out)
        return out

    def scores(self, q: Tensor, K: Tensor) -> Tensor:
        """The four-term relative scores ``(B, H, L, T)`` (unscaled, unmasked; future entries arbitrary)."""
        T = K.shape[2]
        u, vb = self.u.to(q.dtype), self.v_bias.to(q.dtype)          # parameters in the computing dtype
        ac = (q + u[None, :, None]) @ K.transpose(-1, -2)                    # content-content + u
        bd = (q + vb[None, :, None]) @ self.rel_encodings(T, q.dtype, q.device).transpose(-1, -2)[None]
        return ac + rel_shift(bd)                                             # content-position + v, shifted

    # -------------------------------------------------------------- memory
    def _memory(self, data: Any, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The memory keys, values and keep flags ``(B, H, M, D)``, ``(B, H, M, E)``, ``(B, M)`` before this call."""
        B, H = q.shape[:2]
        if data is None:
            return (k.new_zeros(B, H, 0, k.shape[-1]), v.new_zeros(B, H, 0, v.shape[-1]),
                    torch.ones(B, 0, dtype=torch.bool, device=q.device))
        mk, mv, keep = data["k"], data["v"], data["keep"]
        if mv.shape[-1] != v.shape[-1]:
            raise InvalidInputError(
                f"{self.impl_name}: the state's memory holds values with E={mv.shape[-1]}, got v with "
                f"E={v.shape[-1]} (v {tuple(v.shape)}); a state serves one value dimension")
        return mk, mv, keep

    def _attended(self, data: Any, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Everything this call attends to before its own keys (the memory; compressive adds more)."""
        return self._memory(data, q, k, v)

    def _check_span(self, T: int) -> None:
        if self.max_distance is not None and T > self.max_distance:
            raise UnsupportedFeatureError(
                self.impl_name, f"an attention span of {T} positions (memory + segment)",
                f"beyond its relative-position table (max_distance={self.max_distance}); build it with a larger "
                "max_distance, a shorter mem_len or feed shorter segments")

    def _keep_part(self, data: Any, S: int, kpm: Tensor | None, B: int, device: torch.device) -> Tensor:
        return torch.ones(B, S, dtype=torch.bool, device=device) if kpm is None else kpm

    def _needs_probabilities(self) -> bool:
        """Whether the state update reads the attention weights (compressive's most-used does)."""
        return False

    def _compute(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, data: Any, scale: float,
                 want_state: bool, training_call: bool, backend: str = "torch") -> tuple[Tensor, Any]:
        B, H, L, _ = q.shape
        S = k.shape[2]
        pk, pv, pkeep = self._attended(data, q, k, v)
        K, V = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        T = K.shape[2]
        self._check_span(T)
        cur_keep = self._keep_part(data, S, kpm, B, q.device)
        keep = causal_keep(L, T, q.device)[None, None] & torch.cat([pkeep, cur_keep], dim=1)[:, None, None, :]
        p = None
        if backend == "sdpa" and not (want_state and self._needs_probabilities()):
            out = self._sdpa(q, K, V, keep, scale)
        else:
            p = masked_softmax(self.scores(q, K) * scale, keep)
            out = p @ V
        if not want_state:
            return out, None
        return out, self._update(data, q, k, v, cur_keep, p, scale, training_call)

    def _sdpa(self, q: Tensor, K: Tensor, V: Tensor, keep: Tensor, scale: float) -> Tensor:
        """The same attention through fused SDPA: content terms in SDPA, position terms as its additive mask.

        ``(q + u)·k`` is SDPA's own product; ``scale * (q + v)·(W_r R_d)`` (shifted) is the float
        ``attn_mask``, ``-inf`` where a key is not kept. Rows that keep no key get an all-zero mask
        (no NaN) and a zero output afterwards.
        """
        T = K.shape[2]
        u, vb = self.u.to(q.dtype), self.v_bias.to(q.dtype)
        bd = (q + vb[None, :, None]) @ self.rel_encodings(T, q.dtype, q.device).transpose(-1, -2)[None]
        any_kept = keep.any(dim=-1, keepdim=True)
        allowed = keep | ~any_kept
        shifted = rel_shift(bd)
        if symbolic(T):  # a dense copy: elementwise ops on the row stride T - 1 ask a guard T - 1 != 1
            shifted = shifted.contiguous()
        bias = (shifted * scale).masked_fill(~allowed, float("-inf"))
        out = torch.nn.functional.scaled_dot_product_attention(q + u[None, :, None], K, V, attn_mask=bias,
                                                               scale=scale)
        return out.masked_fill(~any_kept, 0.0)

    def _trim(self, k_all: Tensor, v_all: Tensor, keep_all: Tensor, sizes: tuple[int, ...], S: int,
              keep_len: int) -> dict[str, Any]:
        """The last ``keep_len`` positions; detached but for the last ``grad_segments`` segments."""
        n = min(keep_len, k_all.shape[2])
        k_all, v_all, keep_all = k_all[:, :, k_all.shape[2] - n:], v_all[:, :, v_all.shape[2] - n:], \
            keep_all[:, keep_all.shape[1] - n:]
        sizes = (tuple(sizes) + (S,))[-self.grad_segments:] if self.grad_segments else ()
        live = min(sum(sizes), n)
        if live == 0:  # all detached (an empty attached slice would still hold the graph)
            k_all, v_all = k_all.detach(), v_all.detach()
        elif live < n:
            cut = n - live
            k_all = torch.cat([k_all[:, :, :cut].detach(), k_all[:, :, cut:]], dim=2)
            v_all = torch.cat([v_all[:, :, :cut].detach(), v_all[:, :, cut:]], dim=2)
        return {"k": k_all, "v": v_all, "keep": keep_all, "sizes": sizes}

    def _update(self, data: Any, q: Tensor, k: Tensor, v: Tensor, cur_keep: Tensor, p: Tensor, scale: float,
                training_call: bool) -> dict[str, Any]:
        mk, mv, mkeep = self._memory(data, q, k, v)
        sizes = () if data is None else data["sizes"]
        return self._trim(torch.cat([mk, k], 2), torch.cat([mv, v], 2), torch.cat([mkeep, cur_keep], 1), sizes,
                          k.shape[2], self.mem_len)

    # ----------------------------------------------------------- contract
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: Any) -> Any:
        if ctx.positions is not None:  # pragma: no cover - refused by the base class (positions=False)
            raise InvalidInputError("positions are not used by transformer-xl")
        out, new = self._compute(q, k, v, ctx.key_padding_mask, ctx.state, ctx.scale, ctx.return_state,
                                 training_call=True, backend=ctx.backend)
        return (out, new) if ctx.return_state else out

    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> Any:
        return None  # an empty memory; tensors appear with the first segment

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        return self._compute(q, k, v, None, state, self.get_scale(q), True, training_call=False,
                             backend=self.resolve_backend(q, k, v))
