"""The one case generator of the conformance kit.

A :class:`Case` is one way to call an attention: a label, the lengths L
(queries) and S (keys), whether it is causal, and the other ``forward``
keyword arguments (masks). :func:`generate` yields every case a spec's
capabilities declare, so every check that needs "all the ways this
implementation may be called" sees the same list:

* every declared causal mode (``causal=False`` if ``noncausal``, ``True`` if ``causal``);
* key padding (``key_padding_mask``): padding at the end (even batch rows)
  and in the middle (odd rows), never key 0;
* ``attn_mask`` (kind ``tensor``): a bool ``(B, H, L, S)`` parity pattern, an
  additive finite bias ``(B, 1, L, S)``, the bias with key padding;
* mask objects, each when its kind is in ``capabilities.mask_kinds``: a sliding
  window, packed documents, a mask function, and a union (``|``);
* cross-attention both ways (L < S and L > S) when ``cross``; causal cross
  (bottom-right aligned) when ``causal_cross``;
* one longer self-attention length (default 67) so block kernels meet more
  than one block and a ragged last one.

The default lengths (L = 9, S = 12, long 67) are multiples of no block size
(8, 16, 64). Cases the instance's limits refuse (``attn.limits``: length
multiples, a maximum length, L must equal S) are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import masks as _masks
from ..spec import Capabilities
from .config import DTYPE_NAMES

__all__ = [
    "Case", "FAMILIES", "generate", "padding_mask", "left_padding_mask", "parity_mask", "additive_bias",
    "bool_to_additive", "document_ids", "window_mask", "function_mask", "union_mask",
]

#: What :func:`generate` can include; a check picks the families it needs.
FAMILIES = ("plain", "padding", "tensor", "objects", "cross", "long")


# ---------------------------------------------------------------- mask inputs
def padding_mask(B: int, S: int, device: torch.device | str = "cpu") -> Tensor:
    """Bool ``(B, S)``, True = real key: even rows pad the last third, odd rows keys 1 and S//2.

    Never key 0 and never a whole row, so no query row is fully masked (causal or not).
    """
    kpm = torch.ones(B, S, dtype=torch.bool, device=device)
    for b in range(B):
        if b % 2 == 0:
            kpm[b, S - max(1, S // 3):] = False
        else:
            kpm[b, 1] = False
            kpm[b, max(2, S // 2)] = False
    return kpm


def left_padding_mask(B: int, S: int, device: torch.device | str = "cpu") -> Tensor:
    """Bool ``(B, S)`` padding the first ``1 + b % 3`` keys of row b (at most S - 2)."""
    kpm = torch.ones(B, S, dtype=torch.bool, device=device)
    for b in range(B):
        kpm[b, : min(S - 2, 1 + b % 3)] = False
    return kpm


def parity_mask(B: int, H: int, L: int, S: int, device: torch.device | str = "cpu") -> Tensor:
    """Bool ``(B, H, L, S)``: query i of (b, h) may see key j iff ``j == 0`` or ``(i + b + h) % 2 == j % 2``."""
    i = torch.arange(L, device=device)[None, None, :, None]
    j = torch.arange(S, device=device)[None, None, None, :]
    b = torch.arange(B, device=device)[:, None, None, None]
    h = torch.arange(H, device=device)[None, :, None, None]
    return ((i + b + h) % 2 == j % 2) | (j == 0)


def additive_bias(B: int, L: int, S: int, device: torch.device | str = "cpu", seed: int = 1000) -> Tensor:
    """A finite float64 additive mask ``(B, 1, L, S)`` drawn N(0, 1) (cast per dtype by :meth:`Case.kwargs`)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, L, S, generator=g, dtype=torch.float64).to(device)


def bool_to_additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``mask`` is True, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def document_ids(B: int, L: int, device: torch.device | str = "cpu") -> Tensor:
    """Int ``(B, L)`` packed-document ids: row b cuts documents at ``2 + b`` and ``L // 2 + 1``."""
    ids = torch.zeros(B, L, dtype=torch.long, device=device)
    for b in range(B):
        ids[b, min(L - 1, 2 + b):] += 1
        ids[b, min(L - 1, L // 2 + 1):] += 1
    return ids


def window_mask() -> _masks.Mask:
    """``sliding_window(before=2, after=1)``: 4 keys around each query."""
    return _masks.sliding_window(2, 1)


def _stride(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return (q - kv) % 3 != 1


def function_mask() -> _masks.Mask:
    """A mask function: query at p sees keys at kv with ``(p - kv) % 3 != 1`` (itself always)."""
    return _masks.from_function(_stride, name="kit-stride")


def _sink(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return kv == 0


def union_mask() -> _masks.Mask:
    """``sliding_window(1) | from_function(kv == 0)``: a window plus an attention sink."""
    return _masks.sliding_window(1) | _masks.from_function(_sink, name="kit-sink")


# ---------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One way to call an attention.

    Attributes:
        label: what the case is, e.g. ``"causal=True, key_padding_mask=<padded (B, S)>"``.
        L, S: query and key lengths (``B``, ``H`` come from the configuration).
        causal: the ``causal=`` argument.
        kw: the other ``forward`` keyword arguments; additive ``attn_mask``
            tensors are float64 and cast to the call's dtype by :meth:`kwargs`.
        kinds: the mask kinds the call needs (:data:`attnkit.masks.MASK_KINDS`).
        family: which family of :data:`FAMILIES` produced it.
    """

    label: str
    L: int
    S: int
    causal: bool
    kw: Mapping[str, Any] = field(default_factory=dict)
    kinds: frozenset[str] = frozenset()
    family: str = "plain"

    @property
    def cross(self) -> bool:
        return self.L != self.S

    @property
    def key_padding_mask(self) -> Tensor | None:
        return self.kw.get("key_padding_mask")

    def kwargs(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """``forward`` keyword arguments; a float ``attn_mask`` is cast to ``dtype``."""
        out = {"causal": self.causal, **self.kw}
        am = out.get("attn_mask")
        if dtype is not None and isinstance(am, Tensor) and am.is_floating_point():
            out["attn_mask"] = am.to(dtype)
        return out

    def mask(self, dtype: torch.dtype | None = None) -> _masks.Mask | None:
        """The one resolved mask object (what ``forward`` and the spec's reference see)."""
        kw = self.kwargs(dtype)
        return _masks.resolve(kw.get("mask"), causal=kw["causal"], key_padding_mask=kw.get("key_padding_mask"),
                              attn_mask=kw.get("attn_mask"))

    def describe(self, dtype: torch.dtype | None = None, **extra: Any) -> str:
        parts = [f"{k}={v!r}" for k, v in extra.items()] + [self.label, f"L={self.L}, S={self.S}"]
        if dtype is not None:
            parts.append(f"dtype={DTYPE_NAMES.get(dtype, dtype)}")
        return ", ".join(parts)


def _modes(caps: Capabilities) -> list[bool]:
    return [c for c, ok in ((False, caps.noncausal), (True, caps.causal)) if ok]


def generate(caps: Capabilities, *, B: int, H: int, L: int, S: int, device: torch.device | str = "cpu",
             families: Iterable[str] = FAMILIES, limits: Any = None, long_length: int | None = None,
             causal_modes: Iterable[bool] | None = None) -> list[Case]:
    """Every case the capabilities declare, in the requested families.

    Args:
        caps: the spec's capabilities (causal modes, ``mask_kinds``, cross, ...).
        B, H, L, S: batch, heads, self-attention length, cross key length.
        device: where mask tensors are made.
        families: a subset of :data:`FAMILIES`.
        limits: an :class:`attnkit.Limits` (the instance's); cases it refuses are left out.
        long_length: the length of the ``"long"`` family (None leaves it out).
        causal_modes: restrict the causal modes (default: every declared one).

    Returns:
        the cases, in a fixed order (labels are unique within one call).
    """
    fam = set(families)
    unknown = fam - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown case families {sorted(unknown)}; known: {FAMILIES}")
    declared = set(caps.mask_kinds or ())
    modes = _modes(caps) if causal_modes is None else [m for m in causal_modes if m in _modes(caps)]
    out: list[Case] = []

    def add(Lq: int, Sk: int, causal: bool, family: str, kinds: Iterable[str] = (),
            show: Mapping[str, str] | None = None, **kw: Any) -> None:
        need = set(kinds) | ({"causal"} if causal else set())
        if "key_padding_mask" in kw:
            need.add("key_padding")
        if "attn_mask" in kw:
            need.add("tensor")
        if not need <= declared:
            return
        if Lq != Sk and not (caps.causal_cross if causal else caps.cross):
            return
        if limits is not None and limits.why_not(Lq, Sk) is not None:
            return
        label = ", ".join([f"causal={causal}"] + [f"{k}={v}" for k, v in (show or {}).items()])
        out.append(Case(label, Lq, Sk, causal, kw, frozenset(need), family))

    for causal in modes:
        if "plain" in fam:
            add(L, L, causal, "plain")
        if "padding" in fam:
            add(L, L, causal, "padding", key_padding_mask=padding_mask(B, L, device),
                show={"key_padding_mask": "<end/middle padded (B, S)>"})
        if "tensor" in fam:
            add(L, L, causal, "tensor", attn_mask=parity_mask(B, H, L, L, device),
                show={"attn_mask": "<bool parity (B, H, L, S)>"})
            add(L, L, causal, "tensor", attn_mask=additive_bias(B, L, L, device),
                show={"attn_mask": "<additive finite bias (B, 1, L, S)>"})
            add(L, L, causal, "tensor", attn_mask=additive_bias(B, L, L, device, seed=1001),
                key_padding_mask=padding_mask(B, L, device),
                show={"attn_mask": "<additive bias>", "key_padding_mask": "<padded>"})
        if "objects" in fam:
            add(L, L, causal, "objects", {"sliding_window"}, mask=window_mask(),
                show={"mask": "sliding_window(2, 1)"})
            add(L, L, causal, "objects", {"document"}, mask=_masks.document(document_ids(B, L, device)),
                show={"mask": "document(<3 docs per row>)"})
            add(L, L, causal, "objects", {"function"}, mask=function_mask(),
                show={"mask": "from_function('kit-stride')"})
            if not causal:  # a union hides the causal part from implementations that do not materialise masks
                add(L, L, causal, "objects", {"union", "sliding_window", "function"}, mask=union_mask(),
                    show={"mask": "sliding_window(1) | from_function('kit-sink')"})
            add(L, L, causal, "objects", {"sliding_window"}, mask=window_mask(),
                key_padding_mask=padding_mask(B, L, device),
                show={"mask": "sliding_window(2, 1)", "key_padding_mask": "<padded>"})
        if "long" in fam and long_length is not None:
            add(long_length, long_length, causal, "long")
            add(long_length, long_length, causal, "long",
                key_padding_mask=padding_mask(B, long_length, device),
                show={"key_padding_mask": "<end/middle padded (B, S)>"})
    if "cross" in fam:
        for Lq, Sk in ((L, S), (S, L)):
            for causal in modes:
                add(Lq, Sk, causal, "cross")
                add(Lq, Sk, causal, "cross", key_padding_mask=padding_mask(B, Sk, device),
                    show={"key_padding_mask": "<end/middle padded (B, S)>"})
    return out
