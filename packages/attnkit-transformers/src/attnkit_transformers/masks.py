"""The mask transformers builds, turned into one attnkit mask object.

transformers hands an attention function either ``None`` (plain causal or no
mask at all, the flag ``is_causal`` decides) or a 4-D mask ``(B|1, 1|H, L, S)``,
bool (True = attend) or additive float (0 = attend, ``-inf`` or the dtype's
minimum = forbidden). :func:`convert` recognises the structured kinds attnkit's
sparse and kernelized mechanisms honour, **by checking every element**:

* causal (bottom-right aligned: query ``i`` sits at position ``S - L + i``,
  which is how transformers places new tokens after a KV cache),
* key padding (a bool ``(B, S)``, True = a real token),
* causal and key padding together (left- or right-padded batches),

and falls back to a tensor mask (``attnkit.masks.from_tensor``) for anything
else, which only mechanisms honouring ``attn_mask`` accept; the others refuse it
with :class:`attnkit.UnsupportedFeatureError`. Nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit import InvalidInputError
from attnkit import masks as M


@dataclass
class Converted:
    """A converted mask.

    Attributes:
        mask: the attnkit mask object, or None (every query sees every key).
        causal: the mask is causal (possibly ``&`` key padding).
        key_padding: bool ``(B, S)`` (True = real token) or None.
        kind: a short description for error messages: ``"none"``, ``"causal"``,
            ``"key_padding"``, ``"causal & key_padding"`` or ``"tensor (shape)"``.
        keys: how many leading keys take part (fewer than S only for a static
            cache's empty slots, which transformers marks with ``attention_mask=None``).
    """

    mask: M.Mask | None
    causal: bool
    key_padding: Tensor | None
    kind: str
    keys: int


def _keep_from_float(m: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(keep bool, bias or None)`` of an additive float mask; the dtype's minimum counts as forbidden."""
    forbidden = m <= torch.finfo(m.dtype).min
    rest = m.masked_fill(forbidden, 0.0)
    if bool((rest == 0).all()):
        return ~forbidden, None
    return ~forbidden, rest


def convert(attention_mask: Tensor | None, *, is_causal: bool, batch: int, L: int, S: int,
            device: torch.device) -> Converted:
    """Turn transformers' ``attention_mask`` into an attnkit mask.

    Args:
        attention_mask: None, or a 4-D ``(B|1, 1|H, L, S)`` bool / additive float tensor.
        is_causal: the attention module's (or the call's) causal flag; used when
            ``attention_mask`` is None, as transformers' ``sdpa`` does.
        batch, L, S: batch size, query length, key length (after the KV cache).
        device: the queries' device.

    Returns:
        a :class:`Converted`.

    Raises:
        InvalidInputError: a mask of another rank or shape than ``(B|1, 1|H, L, S)``,
            or of an integer dtype.
    """
    if attention_mask is None:
        if is_causal and L > 1:
            # transformers passes None for causal only when L == S, or for the prefill of an empty static
            # cache (S > L, the extra keys are empty slots): its sdpa crops those keys, so do we
            return Converted(M.causal(), True, None, "causal", min(S, L) if S > L else S)
        return Converted(None, bool(is_causal), None, "none", S)
    if not isinstance(attention_mask, Tensor):
        raise InvalidInputError(
            f"attention_mask: expected None or a 4-D tensor (B, 1, L, S) from transformers, got "
            f"{type(attention_mask).__name__}; attnkit_transformers registers the 'sdpa' mask builder "
            "for its names, so a BlockMask means the model was set up for flex_attention")
    t = attention_mask
    if t.dim() != 4 or t.shape[-2] != L or t.shape[-1] != S or t.shape[0] not in (1, batch):
        raise InvalidInputError(
            f"attention_mask: expected shape (B={batch} or 1, 1 or H, L={L}, S={S}), got {tuple(t.shape)}")
    if t.dtype == torch.bool:
        keep, bias = t, None
    elif t.is_floating_point():
        keep, bias = _keep_from_float(t)
    else:
        raise InvalidInputError(
            f"attention_mask: expected a bool (True = attend) or additive float 4-D mask, got dtype {t.dtype}")
    if bias is None and bool((keep == keep[:, :1]).all()):
        keep0 = keep[:, 0]                                         # (B', L, S)
        causal = M.causal_keep(L, S, device=keep.device)           # bottom-right aligned
        kp = keep0[:, -1, :]                                        # the last query sees every real key
        if bool((keep0 == (causal & kp[:, None, :])).all()):
            return _structured(True, kp, batch, S)
        kp = keep0[:, 0, :]
        if bool((keep0 == kp[:, None, :]).all()):
            return _structured(False, kp, batch, S)
    if bias is not None:
        t = bias.masked_fill(~keep, float("-inf"))
    else:
        t = keep
    return Converted(M.from_tensor(t.to(device)), False, None, f"tensor {tuple(t.shape)}", S)


def _structured(causal: bool, kp: Tensor, batch: int, S: int) -> Converted:
    kp = kp.expand(batch, S)
    parts = []
    if causal:
        parts.append(M.causal())
    padded = not bool(kp.all())
    if padded:
        parts.append(M.key_padding(kp.contiguous()))
    if not parts:
        return Converted(None, False, None, "none", S)
    mask = parts[0] if len(parts) == 1 else parts[0] & parts[1]
    kind = " & ".join(p for p, on in (("causal", causal), ("key_padding", padded)) if on)
    return Converted(mask, causal, kp if padded else None, kind, S)
