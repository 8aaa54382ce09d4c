"""``memory-tokens``: memory slots prepended to every segment, read and written through attention (after RMT).

Bulatov, Kuratov, Burtsev (2022), "Recurrent Memory Transformer", arXiv:2207.06881.

The attention-level form of RMT: each attention module keeps ``num_memory``
memory slots per head (a key ``(N, D)`` and a value ``(N, E)`` each; the
initial keys are learned, the initial values are 0), and for every segment
(one ``forward(..., state=..., return_state=True)`` or ``step``):

* read: the segment's queries attend to ``[memory slots | segment keys]``;
  the slots are visible to every query (prepended), the segment causally;
  a query that sees no key of its segment (all padded, or before the first
  key when L > S) gives 0, as in every attnkit attention;
* write: the slots' queries ``q_m = m_k W_q`` attend to ``[memory | segment]``
  (all of the segment: the write happens at its end, like RMT's write
  tokens) with weights ``A``, and the slots become ``(A K) W_k`` and ``A V``
  (convex combinations of the slots and the segment's keys/values, so the
  state stays bounded over any number of segments; ``W_q`` and ``W_k`` start
  at the identity; no parameter depends on E, so any value width works;
  residual updates ``m + ...`` were tried first and made the slot values grow
  with every segment, which trained markedly worse in the lab);
* the new slots are the state carried to the next segment.

Gradients through memory: the memory is detached at every
``(grad_segments + 1)``-th segment boundary (truncated backpropagation
through time in blocks of ``grad_segments + 1`` segments); 0 detaches it at
every boundary. A call without state reads the initial slots (and returns
nothing). RMT proper passes memory tokens through the whole layer stack;
here every attention layer reads and writes its own slots.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import Attention
from attnkit.errors import InvalidInputError

from ..common import Float32Inside, causal_keep, check_int_option, masked_softmax

__all__ = ["MemoryTokenAttention"]


class MemoryTokenAttention(Float32Inside, Attention):
    """Recurrent memory slots read and written through attention, carried across segments.

    Args:
        num_heads: heads H (required: per-head slots and write projections).
        head_dim: head dimension D (required).
        num_memory: memory slots N >= 1 per head.
        grad_segments: truncated backpropagation: memory detached every
            ``grad_segments + 1`` segments (0: at every boundary).
        scale: score multiplier; None: 1/sqrt(D).
        backend: only ``"torch"``.

    Shapes: ``q`` ``(B, H, L, D)``, ``k`` ``(B, H, S, D)``, ``v`` ``(B, H, S, E)`` -> ``(B, H, L, E)``;
    causal only (bottom-right when L != S).

    Raises:
        InvalidInputError: missing ``num_heads``/``head_dim``, ``num_memory`` < 1,
            ``grad_segments`` < 0; in forward, a state from another module, batch,
            dtype, device or configuration, or whose slots have another E.
    """

    option_constraints = {"num_memory": {"minimum": 1}, "grad_segments": {"minimum": 0}}

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, num_memory: int = 8,
                 grad_segments: int = 0, scale: float | None = None,
                 backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        if num_heads is None or head_dim is None:
            raise InvalidInputError(
                f"{type(self).__name__}: num_heads and head_dim are required (memory slots are per head), got "
                f"num_heads={num_heads!r}, head_dim={head_dim!r}")
        check_int_option("num_memory", num_memory, 1)
        check_int_option("grad_segments", grad_segments, 0)
        self.num_memory, self.grad_segments = num_memory, grad_segments
        H, D, N = num_heads, head_dim, num_memory
        self.mem_k = nn.Parameter(torch.randn(H, N, D))              # initial slot keys (values start at 0)
        self.w_q = nn.Parameter(torch.eye(D).repeat(H, 1, 1))       # slot queries q_m = m_k W_q
        self.w_k = nn.Parameter(torch.eye(D).repeat(H, 1, 1))  # attended keys -> new keys

    def state_owner(self) -> tuple[str, str]:
        name, conf = super().state_owner()
        return name, f"{conf}; num_memory={self.num_memory}; grad_segments={self.grad_segments}"

    def _slots(self, data: Any, v: Tensor) -> tuple[Tensor, Tensor, int]:
        B, H = v.shape[:2]
        if data is None:
            mk = self.mem_k.to(v.dtype)[None].expand(B, -1, -1, -1)
            return mk, v.new_zeros(B, H, self.num_memory, v.shape[-1]), 0
        if data["v"].shape[-1] != v.shape[-1]:
            raise InvalidInputError(
                f"{self.impl_name}: the state's slots hold values with E={data['v'].shape[-1]}, got v "
                f"{tuple(v.shape)}; a state serves one value dimension")
        return data["k"], data["v"], data["since"]

    def _compute(self, q: Tensor, k: Tensor, v: Tensor, kpm: Tensor | None, data: Any, scale: float,
                 want_state: bool) -> tuple[Tensor, Any]:
        B, H, L, _ = q.shape
        S, N = k.shape[2], self.num_memory
        mk, mv, since = self._slots(data, v)
        K, V = torch.cat([mk, k], 2), torch.cat([mv, v], 2)
        real = torch.ones(B, S, dtype=torch.bool, device=q.device) if kpm is None else kpm
        real_all = torch.cat([torch.ones(B, N, dtype=torch.bool, device=q.device), real], 1)[:, None, None, :]
        seg = causal_keep(L, S, q.device)
        keep = torch.cat([torch.ones(L, N, dtype=torch.bool, device=q.device), seg], 1)[None, None] & real_all
        out = masked_softmax((q @ K.transpose(-1, -2)) * scale, keep) @ V
        sees = keep[..., N:].any(-1, keepdim=True)              # a row that sees no key of its segment gives 0
        out = out.masked_fill(~sees, 0.0)
        if not want_state:
            # w_q and w_k only write the next slots, which a forward without return_state never computes: they
            # join the graph with an exactly zero value and gradient (a select, not 0 * p: a NaN parameter
            # cannot reach the output), so DistributedDataParallel(find_unused_parameters=False) sees them used
            params = (self.w_q.sum() + self.w_k.sum()).to(out.dtype)
            none = torch.zeros((), dtype=torch.bool, device=out.device)
            return out + torch.where(none, params, torch.zeros((), dtype=out.dtype, device=out.device)), None
        qm = mk @ self.w_q.to(mk.dtype)[None]                                 # (B, H, N, D)
        a = masked_softmax((qm @ K.transpose(-1, -2)) * scale, real_all.expand(B, 1, N, N + S))
        nk, nv = (a @ K) @ self.w_k.to(K.dtype)[None], a @ V
        since += 1
        if since > self.grad_segments:
            nk, nv, since = nk.detach(), nv.detach(), 0
        return out, {"k": nk, "v": nv, "since": since}

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: Any) -> Any:
        out, new = self._compute(q, k, v, ctx.key_padding_mask, ctx.state, ctx.scale, ctx.return_state)
        return (out, new) if ctx.return_state else out

    def _init_state(self, batch: int, *, device: torch.device | None, dtype: torch.dtype | None) -> Any:
        return None  # the learned initial slots, expanded at the first segment

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        return self._compute(q, k, v, None, state, self.get_scale(q), True)
