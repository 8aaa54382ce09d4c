"""``compressive``: Transformer-XL attention over a compressed memory, the memory and the segment.

Rae, Potapenko, Jayakumar, Hillier, Lillicrap (2020), arXiv:1911.05507.

A call attends (with Transformer-XL's four-term relative attention, distances
counted along the concatenation) to ``[compressed memory | memory | segment]``.
After the call, ``memory + segment`` keeps its last ``mem_len`` positions;
the positions evicted from it are compressed in groups of ``c``
(``compression_rate``) into one slot each, appended to the compressed memory,
which keeps its last ``cmem_len`` slots. Positions are evicted only in whole
groups of ``c``: the memory holds between ``mem_len`` and ``mem_len + c - 1``
positions (a partial group waits in the memory, still attended, until it is
complete), so no position is ever dropped uncompressed.

Compression functions ``f_c`` (keys and values alike): ``"max"``/``"mean"``
pooling over each group (over its real positions), ``"conv"`` (a 1D
convolution of kernel and stride ``c`` over time, one for keys and one for
values, initialised to mean pooling), ``"most_used"`` (of the ``n`` evicted
positions keep the ``n / c`` that received the most attention while in
memory, in time order).

The attention-reconstruction loss (auxiliary loss ``attention_reconstruction``),
recorded by ``forward`` under autograd whenever positions are compressed::

    || attn(sg(q), sg(old_k), sg(old_v)) - attn(sg(q), f_c(sg(old_k)), f_c(sg(old_v))) ||^2  (mean)

with content-only softmax attention from the segment's queries; stop-gradients
(``sg``) everywhere but ``f_c``, so it trains only the compression (the
convolution), as in the paper. The compressed memory itself is stored
detached: the task loss does not train ``f_c``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit.errors import InvalidInputError

from ..common import check_int_option
from ..transformer_xl.module import TransformerXLAttention

__all__ = ["CompressiveAttention", "COMPRESSIONS", "content_attention"]

COMPRESSIONS = ("max", "mean", "conv", "most_used")


def content_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, scale: float) -> Tensor:
    """softmax(scale q k^T) v over keys with ``keep`` ``(B, S)`` (rows without keys give 0)."""
    s = (q @ k.transpose(-1, -2)) * scale
    kp = keep[:, None, None, :]
    s = s.masked_fill(~kp, float("-inf")).masked_fill(~kp.any(-1, keepdim=True), 0.0)
    return torch.softmax(s, -1).masked_fill(~kp, 0.0) @ v


class CompressiveAttention(TransformerXLAttention):
    """Compressive Transformer attention: Transformer-XL memory plus a compressed memory.

    Args:
        num_heads: heads H (required).
        head_dim: head dimension D (required).
        mem_len: memory length M >= 1 (holds M to M + c - 1 positions, see the module docs).
        cmem_len: compressed memory length (slots) >= 1.
        compression_rate: c >= 1 evicted positions per compressed slot.
        compression: ``"max"``, ``"mean"``, ``"conv"`` or ``"most_used"``.
        value_dim: value dimension E for ``"conv"`` (its value convolution); None: D.
        grad_segments: keep the memory of the last N segments in the graph (0: detached).
        rel_dim: width of the sinusoidal relative encodings; None: H*D.
        max_distance: longest span ``Mc + M + S`` accepted; None: no limit.
        scale: score multiplier; None: 1/sqrt(D).
        backend: ``"auto"``, ``"sdpa"`` or ``"torch"`` (as Transformer-XL; ``"most_used"``
            needs the attention weights, so its stateful calls run the torch path).

    Shapes: as :class:`~attnkit_memory.transformer_xl.module.TransformerXLAttention`.

    Raises:
        InvalidInputError: an option out of range (``cmem_len`` or
            ``compression_rate`` < 1, an unknown ``compression``); with
            ``"conv"``, values whose E is not ``value_dim``; a state from another
            module, batch, dtype, device or configuration.
    """

    option_constraints = {
        "cmem_len": {"minimum": 1},
        "compression_rate": {"minimum": 1},
        "compression": {"choices": COMPRESSIONS},
        "value_dim": {"minimum": 1},
    }

    def __init__(self, *, num_heads: int | None = None, head_dim: int | None = None, mem_len: int = 64,
                 cmem_len: int = 64, compression_rate: int = 4, compression: str = "mean",
                 value_dim: int | None = None, grad_segments: int = 0, rel_dim: int | None = None,
                 max_distance: int | None = None, scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, mem_len=mem_len, grad_segments=grad_segments,
                         rel_dim=rel_dim, max_distance=max_distance, scale=scale, backend=backend)
        check_int_option("cmem_len", cmem_len, 1)
        check_int_option("compression_rate", compression_rate, 1)
        check_int_option("value_dim", value_dim, 1, allow_none=True)
        if compression not in COMPRESSIONS:
            raise InvalidInputError(f"compression: expected one of {COMPRESSIONS}, got {compression!r}")
        self.cmem_len, self.rate, self.compression = cmem_len, compression_rate, compression
        self.value_dim = head_dim if value_dim is None else value_dim
        self.conv_k: nn.Parameter | None = None
        self.conv_v: nn.Parameter | None = None
        if compression == "conv":  # (out, c, in) weights, initialised to mean pooling
            c = compression_rate
            self.conv_k = nn.Parameter(torch.eye(head_dim)[:, None, :].repeat(1, c, 1) / c)
            self.conv_v = nn.Parameter(torch.eye(self.value_dim)[:, None, :].repeat(1, c, 1) / c)

    def _option_fingerprint(self) -> str:
        return (f"{super()._option_fingerprint()}; cmem_len={self.cmem_len}; compression_rate={self.rate}; "
                f"compression={self.compression}; value_dim={self.value_dim}")

    # ------------------------------------------------------------ compression
    def compress(self, k: Tensor, v: Tensor, keep: Tensor, usage: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """``f_c`` of ``n = g * c`` evicted positions: ``(B, H, n, ·)`` -> ``(B, H, g, ·)``, keep ``(B, g)``.

        Args:
            k, v: evicted keys ``(B, H, n, D)`` and values ``(B, H, n, E)``.
            keep: ``(B, n)`` real positions.
            usage: ``(B, n)`` attention received (``"most_used"`` only).
        """
        B, H, n, D = k.shape
        E, c = v.shape[-1], self.rate
        g = n // c
        gkeep = keep.view(B, g, c)
        slot_keep = gkeep.any(-1)
        if self.compression == "most_used":
            score = usage.masked_fill(~keep, -1.0)
            top = torch.sort(torch.sort(score, dim=1, descending=True, stable=True).indices[:, :g], dim=1).values
            idx = top[:, None, :, None]
            return (k.gather(2, idx.expand(B, H, g, D)), v.gather(2, idx.expand(B, H, g, E)),
                    keep.gather(1, top))
        kk, vv = k.reshape(B, H, g, c, D), v.reshape(B, H, g, c, E)
        m = gkeep[:, None, :, :, None]
        if self.compression == "mean":
            cnt = m.sum(3).clamp_min(1).to(k.dtype)
            return (kk * m).sum(3) / cnt, (vv * m).sum(3) / cnt, slot_keep
        if self.compression == "max":
            ninf = float("-inf")
            ck, cv = kk.masked_fill(~m, ninf).amax(3), vv.masked_fill(~m, ninf).amax(3)
            sk = slot_keep[:, None, :, None]
            return ck.masked_fill(~sk, 0.0), cv.masked_fill(~sk, 0.0), slot_keep
        if v.shape[-1] != self.value_dim:
            raise InvalidInputError(
                f"{self.impl_name}: compression='conv' was built for values with E=value_dim={self.value_dim}, "
                f"got E={v.shape[-1]}; build it with value_dim={v.shape[-1]}")
        ck = torch.einsum("bhgci,oci->bhgo", kk, self.conv_k.to(k.dtype))
        cv = torch.einsum("bhgci,oci->bhgo", vv, self.conv_v.to(v.dtype))
        return ck, cv, slot_keep

    def _needs_probabilities(self) -> bool:
        return self.compression == "most_used"

    # ---------------------------------------------------------------- memory
    def _attended(self, data: Any, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mk, mv, mkeep = self._memory(data, q, k, v)
        if data is None or data["ck"] is None:
            return mk, mv, mkeep
        return (torch.cat([data["ck"], mk], 2), torch.cat([data["cv"], mv], 2),
                torch.cat([data["ckeep"], mkeep], 1))

    def _update(self, data: Any, q: Tensor, k: Tensor, v: Tensor, cur_keep: Tensor, p: Tensor, scale: float,
                training_call: bool) -> dict[str, Any]:
        mk, mv, mkeep = self._memory(data, q, k, v)
        k_all, v_all, keep_all = torch.cat([mk, k], 2), torch.cat([mv, v], 2), torch.cat([mkeep, cur_keep], 1)
        usage = None
        if self.compression == "most_used":  # attention received by memory + segment positions, summed
            got = p.detach().sum(dim=(1, 2))[:, p.shape[-1] - k_all.shape[2]:]
            prev = data["usage"] if data is not None else None
            usage = got if prev is None else got + torch.cat([prev, got.new_zeros(got.shape[0], k.shape[2])], 1)
        n = k_all.shape[2]
        n_ev = ((n - self.mem_len) // self.rate) * self.rate if n > self.mem_len else 0
        ck, cv, ckeep = (None, None, None) if data is None else (data["ck"], data["cv"], data["ckeep"])
        if n_ev:
            old_k, old_v, old_keep = k_all[:, :, :n_ev].detach(), v_all[:, :, :n_ev].detach(), keep_all[:, :n_ev]
            new_k, new_v, new_keep = self.compress(old_k, old_v, old_keep, None if usage is None else usage[:, :n_ev])
            if training_call and torch.is_grad_enabled():
                qd = q.detach()
                want = content_attention(qd, old_k, old_v, old_keep, scale)
                got = content_attention(qd, new_k, new_v, new_keep, scale)
                self.record_aux_loss("attention_reconstruction", (want - got).pow(2).mean())
            new_k, new_v = new_k.detach(), new_v.detach()
            ck = new_k if ck is None else torch.cat([ck, new_k], 2)
            cv = new_v if cv is None else torch.cat([cv, new_v], 2)
            ckeep = new_keep if ckeep is None else torch.cat([ckeep, new_keep], 1)
            ck, cv, ckeep = ck[:, :, -self.cmem_len:], cv[:, :, -self.cmem_len:], ckeep[:, -self.cmem_len:]
        sizes = () if data is None else data["sizes"]
        new = self._trim(k_all, v_all, keep_all, sizes, k.shape[2], n - n_ev)
        new.update(ck=ck, cv=cv, ckeep=ckeep, usage=None if usage is None else usage[:, n_ev:])
        return new
