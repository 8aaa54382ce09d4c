"""``lsh`` (alias ``reformer``): Reformer's shared-QK LSH attention.

Per round: hash, sort by ``(bucket, position)`` and cut the sorted sequence into
chunks — query chunk ``c`` sees key chunks ``c - 1`` and ``c`` with the element
masks (not itself, causal by original positions, key padding) — so the cost is
proportional to the attended pairs (``L · 2·bucket_size`` per round); the rounds
are combined by their log-sum-exp. On CPU (``numba``) every round runs in the
fused kernels of :mod:`.fused`, which read the rows through the permutation
and merge the rounds at each position; ``torch`` and ``triton`` gather the
sorted rows and run the block-sparse engine on an explicit plan of the sorted
sequence, then unsort and combine. See :mod:`.hashing` and the reference in
:mod:`.naive`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit import Attention
from attnkit.caching import cached
from attnkit.context import CallContext

from .._half import is_half, wide
from ..base import check_int, content_backend_order
from .hashing import buckets, n_buckets, real_lengths, rotations, sort_rounds, sort_rounds_inverse, unit

__all__ = ["LSHAttention"]


def _chunks(x: Tensor, cs: int, fill: Any) -> Tensor:
    """``(..., L)`` -> ``(..., NQ, cs)``, padded with ``fill`` past L."""
    L = x.shape[-1]
    nq = -(-L // cs)
    pad = nq * cs - L
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.view(*x.shape[:-1], nq, cs)


def _with_previous(xc: Tensor, fill: Any) -> Tensor:
    """``(..., NQ, cs)`` -> ``(..., NQ, 2, cs)``: the previous chunk (``fill`` before chunk 0), then the chunk."""
    prev = torch.cat([torch.full_like(xc[..., :1, :], fill), xc[..., :-1, :]], -2)
    return torch.stack([prev, xc], -2)


def chunk_masks_torch(perm: Tensor, kpm: Tensor | None, cs: int, causal: bool) -> Tensor:
    """bool ``(B, H, R, NQ, 2, cs, cs)``: may sorted row ``i`` of chunk ``c`` attend row ``j`` of chunk ``c - 1``
    (slot 0) / ``c`` (slot 1)? Not itself, not a padded key, not the future when causal; False past L."""
    B = perm.shape[0]
    qpos = _chunks(perm, cs, -1)                                         # (B, H, R, NQ, cs)
    kpos = _with_previous(qpos, -1)                                      # (B, H, R, NQ, 2, cs)
    qp, kp = qpos[..., None, :, None], kpos[..., None, :]
    bank = (kp >= 0) & (qp >= 0) & (kp != qp)
    if causal:
        bank = bank & (kp <= qp)
    if kpm is not None:
        kok = kpm.gather(1, kpos.clamp(min=0).reshape(B, -1)).view(kpos.shape)
        bank = bank & kok[..., None, :]
    return bank


class LSHAttention(Attention):
    """Reformer's LSH attention (Kitaev, Kaiser, Levskaya 2020), shared-QK; CPU: fused kernels, else the engine.

    Keys are the unit vectors ``k̂_j = k_j / ‖k_j‖`` and positions are hashed by
    their key, ``h(k_j) = argmax([k_j R; -k_j R])`` with random rotations ``R``
    drawn from ``seed`` (``n_hashes`` rounds). Shared-QK: attnkit's layers pass
    ``k = q`` and build no key projection (the spec declares ``shared_qk``);
    called directly, ``k`` is whatever you give (``forward(q, q, v)`` is
    Reformer). Each round sorts positions by ``(bucket, position)`` and cuts the
    sorted sequence into chunks of ``bucket_size``; a position attends the
    positions of its chunk and of the previous chunk (chunk 0 has none), never
    itself, only the past with ``causal`` (by original positions), never a
    padded key. The rounds are combined by their log-sum-exp, i.e. one softmax
    of ``scale·q_i·k̂_j`` over the union of the rounds' pairs, a pair counted
    once per round that holds it. A position with no pair in any round
    attends to itself only (output ``v_i``), as in the paper.

    Buckets: 1 when ``L <= bucket_size`` (one chunk: exact shared-QK attention
    with the self rule), else ``ceil(L / bucket_size)`` rounded up to even.
    Padded keys count as absent: they sort after every real position and the
    bucket count is that of each batch element's real length.
    Any ``L`` works (the last chunk may be short). The chunk assignment depends
    on every position's bucket, future ones included: with ``causal`` no output
    attends the future, but which past keys share its chunk can change when a
    later token changes (as in the paper).

    Shapes: q ``(B, H, L, D)``, k ``(B, H, L, D)``, v ``(B, H, L, E)`` -> ``(B, H, L, E)``
    (self-attention: L = S).

    Args:
        bucket_size: chunk length of the sorted sequence, an int >= 1 (Reformer: 64). Default 64.
        n_hashes: hash rounds, an int >= 1 (more rounds, fewer misses, proportionally more work). Default 4.
        seed: seed of the random rotations (an int >= 0): same seed, same hashes. Default 0.
        num_heads: number of heads H; when given, inputs with another H are refused.
        head_dim: head dimension D; when given, inputs with another D are refused.
        scale: multiplier of q·k̂; None means 1/sqrt(D).
        backend: "auto", "numba" (CPU kernels), "torch" (any device) or "triton" (CUDA kernels
            for the attention inside the reordered blocks; block sizes powers of two >= 16). ``auto`` picks
            triton on CUDA for float16/bfloat16 inputs (measured faster than torch there), torch for float32.

    Raises:
        InvalidInputError: an option out of range (named), or inputs the base class refuses.
        UnsupportedFeatureError: masks other than causal and key padding, cross-attention, positions.
    """

    option_constraints: ClassVar[dict[str, dict[str, Any]]] = {
        "bucket_size": {"minimum": 1}, "n_hashes": {"minimum": 1}, "seed": {"minimum": 0},
        "backend": {"choices": ("auto", "numba", "torch", "triton")},
    }
    refusal_reasons: ClassVar[dict[str, str]] = {
        "cross": "shared-QK LSH hashes one sequence: queries and keys are the same positions",
        "attn_mask": "the attended pairs come from the hashes; only causal and key padding compose with them",
    }

    def __init__(self, *, bucket_size: int = 64, n_hashes: int = 4, seed: int = 0, num_heads: int | None = None,
                 head_dim: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.bucket_size = check_int("bucket_size", bucket_size)
        self.n_hashes = check_int("n_hashes", n_hashes)
        self.seed = check_int("seed", seed, minimum=0)
        self._rot: dict[tuple[Any, ...], Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_rot"] = {}
        return state

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, bucket_size={self.bucket_size}, n_hashes={self.n_hashes}, "
                f"seed={self.seed}")

    def rotations(self, L: int, D: int, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``(n_hashes, D, n_buckets / 2)`` rotations for length ``L`` (cached per shape, dtype, device; float32
        for a half ``dtype``: half inputs are hashed in float32)."""
        dtype = wide(dtype)
        L = int(L)   # a dynamic length of a torch.export trace: the bucket count follows it (specialised)
        cols = max(1, n_buckets(L, self.bucket_size) // 2)
        # cached (attnkit.caching.cached: never a torch.func transform's wrapper, an inference tensor or a fake one)
        return cached(self._rot, (cols, D, dtype, str(device)),
                      lambda: rotations(self.seed, self.n_hashes, D, cols, dtype=dtype, device=device), limit=8)

    def sorted_rounds_inverse(self, k: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`sorted_rounds` and its inverse permutation (position -> sorted index), ``(B, H, n_hashes, L)``."""
        B, H, L, D = k.shape
        rot = self.rotations(L, D, dtype=k.dtype, device=k.device)
        lengths = real_lengths(B, L, key_padding_mask, k.device)
        return sort_rounds_inverse(buckets(k, rot, self.bucket_size, lengths), key_padding_mask)

    def sorted_rounds(self, k: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """``perm`` ``(B, H, n_hashes, L)``: each round's positions in sorted ``(bucket, position)`` order.

        ``key_padding_mask`` ``(B, L)`` (True = real): padded positions sort last and each batch element
        has the buckets of its real length, so padded keys count as absent.
        """
        B, H, L, D = k.shape
        rot = self.rotations(L, D, dtype=k.dtype, device=k.device)
        lengths = real_lengths(B, L, key_padding_mask, k.device)
        return sort_rounds(buckets(k, rot, self.bucket_size, lengths), key_padding_mask)

    def _plan(self, perm: Tensor, kpm: Tensor | None, cs: int, causal: bool) -> Any:
        """The engine's plan of the sorted rounds (torch and triton backends): chunk ``c`` x chunks ``(c - 1, c)``
        with their element masks."""
        from ..engine import band_plan

        B, H, R, L = perm.shape
        bank = chunk_masks_torch(perm, kpm, cs, causal)
        return band_plan(bank.view(B, H * R, *bank.shape[3:]), L)

    def _shared_plan(self, L: int, cs: int, device: torch.device) -> Any:
        """The plan without causal or key padding, index dims ``(1, 1)``: sorted row ``i`` of chunk ``c`` may attend
        every row of chunk ``c - 1`` and of chunk ``c`` but itself (a round sorts a permutation, so a position
        meets itself only on the diagonal of its own chunk), never a row past ``L``. It depends on ``L`` and
        the chunk size only: cached, built without a pass over the sorted positions."""
        L, cs = int(L), int(cs)   # (a dynamic length of a torch.export trace is specialised: the plan follows it)
        return cached(self._rot, ("plan", L, cs, str(device)), lambda: self._build_shared_plan(L, cs, device),
                      limit=8)

    @staticmethod
    def _build_shared_plan(L: int, cs: int, device: torch.device) -> Any:
        from ..engine import band_plan

        nq = -(-L // cs)
        row = torch.arange(nq * cs, device=device).view(nq, cs)
        real = row < L
        prev = torch.cat([torch.zeros_like(real[:1]), real[:-1]], 0)           # chunk c - 1 (none for 0)
        eye = torch.eye(cs, dtype=torch.bool, device=device)
        slot0 = real[:, :, None] & prev[:, None, :]
        slot1 = real[:, :, None] & real[:, None, :] & ~eye
        bank = torch.stack([slot0, slot1], 1).view(1, 1, nq, 2, cs, cs)
        return band_plan(bank, L)

    def _attend_numba(self, q: Tensor, k: Tensor, v: Tensor, perm: Tensor, kpm: Tensor | None, causal: bool,
                      cs: int, scale: float) -> Tensor:
        """The CPU path: every round at once in the fused kernels of :mod:`.fused` (rows read through ``perm``,
        the rounds merged by their log-sum-exp at each position; no sorted copies, no plan)."""
        from .fused import attend_rounds

        out, alone = attend_rounds(q, unit(k), v, perm, kpm, causal=causal, chunk=cs, scale=scale)
        if kpm is not None:
            alone = alone & kpm[:, None, :]
        if not bool(alone.any()):
            return out
        return torch.where(alone[..., None], v, out)                    # no pair in any round: itself only

    def backend_order(self, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
        """``auto``: triton first for half inputs on CUDA (measured), see :func:`..base.content_backend_order`."""
        return content_backend_order(tuple(self.caps.backends), device, dtype, self.bucket_size)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        if is_half(q.dtype):
            if ctx.backend != "triton":   # numba and torch compute in float32 anyway: hash, attend, combine there
                return self._attend(q.float(), k.float(), v.float(), ctx).to(q.dtype)
            # triton: hashes in float32 (buckets), half operands to the kernels, the rounds combined in float32
            return self._attend_rounds(q, k, v, ctx).to(q.dtype)
        return self._attend_rounds(q, k, v, ctx)

    def _attend_rounds(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        from ..engine import attend_plan

        B, H, L, D = q.shape
        E = v.shape[-1]
        R, cs = self.n_hashes, min(self.bucket_size, L)
        kpm = ctx.key_padding_mask
        kpm = None if kpm is None else kpm.to(q.device)
        if ctx.backend == "numba":
            perm = self.sorted_rounds(k, kpm)                            # (B, H, R, L)
            return self._attend_numba(q, k, v, perm, kpm, ctx.causal, cs, ctx.scale)
        perm, inv = self.sorted_rounds_inverse(k, kpm)                   # (B, H, R, L)
        if kpm is None and not ctx.causal:   # the masks are "not itself" only: one bank for every head and round
            plan = self._shared_plan(L, cs, q.device)
        else:
            plan = self._plan(perm, kpm, cs, ctx.causal)
        # the sorted sequences, one per round, as heads of the engine: rows of (B·H·L, D) picked by index
        flat = (perm + (torch.arange(B * H, device=q.device) * L).view(B, H, 1, 1)).reshape(-1)
        qs = q.reshape(B * H * L, D).index_select(0, flat).view(B, H * R, L, D)
        ks = unit(k).reshape(B * H * L, D).index_select(0, flat).view(B, H * R, L, D)
        vs = v.reshape(B * H * L, E).index_select(0, flat).view(B, H * R, L, E)
        out_s, lse_s = attend_plan(qs, ks, vs, plan, scale=ctx.scale, backend=ctx.backend, return_lse=True)
        # unsort and combine the rounds by their log-sum-exp
        inv_flat = (inv + (torch.arange(B * H * R, device=q.device) * L).view(B, H, R, 1)).reshape(-1)
        out_r = out_s.reshape(B * H * R * L, E).index_select(0, inv_flat).view(B, H, R, L, E)
        lse_r = lse_s.reshape(-1).index_select(0, inv_flat).view(B, H, R, L)
        m = lse_r.detach().amax(2, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(lse_r - m)                                         # 0 for a round with no pair
        den = w.sum(2, keepdim=True)
        w = w / torch.where(den > 0, den, torch.ones_like(den))
        out = (w[..., None] * out_r.to(w.dtype)).sum(2)                  # (B, H, L, E); float32 for half inputs
        alone = den[:, :, 0] == 0                                        # no pair in any round: itself only
        if kpm is not None:
            alone = alone & kpm[:, None, :]
        return torch.where(alone[..., None], v.to(out.dtype), out)
