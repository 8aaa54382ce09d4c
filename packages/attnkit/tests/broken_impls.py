"""Deliberately broken attention implementations that the conformance kit must catch.

Each class breaks one rule of the contract and is otherwise an ordinary
softmax attention (or, for the window, an ordinary local attention), so the
check that catches it is the one aimed at that rule. They are registered
only inside tests, with ``attnkit.registered(...)``; :data:`CASES` says how
(spec fields) and which check must fail. Shapes: q ``(B, H, L, D)``, k
``(B, H, S, D)``, v ``(B, H, S, E)``.

Since contract 2 the base class zeroes k and v at padded keys before an
implementation sees them; faults in padding handling therefore show in the
``reference`` and ``key_padding`` checks (output vs the keys removed), or,
for implementations that bypass the base (override ``forward``), in
``gradients`` and ``padded_values``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnkit import Attention, AttentionState, CallContext, Capabilities
from attnkit import masks as M
from attnkit.masks import causal_keep
from attnkit.reference import masked_softmax_attention, naive_attention

BASIC = Capabilities()  # causal, noncausal, key padding, cross; float32/float64; torch backend


class NaiveAttention(Attention):
    """Correct softmax attention (the base the broken ones change one thing in), with a KV cache."""

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
                 key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> Tensor:
        return naive_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                               attn_mask=attn_mask, scale=self.get_scale(q))

    def _init_state(self, batch: int, *, device: Any, dtype: Any) -> dict[str, Any]:
        return {"k": None, "v": None}

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        keys = k if state["k"] is None else torch.cat([state["k"], k], 2)
        values = v if state["v"] is None else torch.cat([state["v"], v], 2)
        out = self._forward(q, keys, values, causal=True, key_padding_mask=None, attn_mask=None)
        return out, {"k": keys, "v": values}


# ------------------------------------------------------------ the five of the issue
class LeakyFutureAttention(NaiveAttention):
    """Off-by-one causal mask: query i also sees key i + 1 (leaks the future)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if causal:
            L, S = q.shape[-2], k.shape[-2]
            leak = causal_keep(L, S, device=q.device) | causal_keep(L, S, device=q.device).roll(1, dims=1)
            attn_mask = leak if attn_mask is None else attn_mask & leak
        return naive_attention(q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                               scale=self.get_scale(q))


class IgnoresPaddingAttention(NaiveAttention):
    """Declares key_padding_mask but drops it without a word."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        return naive_attention(q, k, v, causal=causal, attn_mask=attn_mask, scale=self.get_scale(q))


class NaNOnMaskedRowAttention(NaiveAttention):
    """Textbook masked softmax: a fully masked row is softmax(all -inf) = NaN."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        scores = q @ k.transpose(-2, -1) * self.get_scale(q)
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if causal:
            keep = causal_keep(q.shape[-2], k.shape[-2], device=q.device)
        if key_padding_mask is not None:
            keep = keep & key_padding_mask[:, None, None, :]
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v



class NaNInTrainingAttention(NaiveAttention):
    """Correct in eval mode; in training mode a noise term takes the log of a negative number (NaN everywhere)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        out = super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        if self.training:
            u = torch.rand((), dtype=out.dtype, device=out.device)
            out = out + 0.0 * torch.log(-torch.log(u).clamp(min=1e-20))   # the .clamp binds before the minus
        return out

class StreamingMismatchAttention(NaiveAttention):
    """Declares exact streaming, but each step forgets the earlier chunks (no KV cache)."""

    def _step(self, q, k, v, state):
        out = self._forward(q, k, v, causal=True, key_padding_mask=None, attn_mask=None)
        return out, state


class ClaimsAttnMaskAttention(NaiveAttention):
    """Claims the attn_mask capability it lacks: the mask is accepted and ignored."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        return naive_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                               scale=self.get_scale(q))


# ------------------------------------------------------------------ more faults
class ClaimsStreamingAttention(Attention):
    """Claims exact streaming but implements only the parallel form."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        return naive_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                               attn_mask=attn_mask, scale=self.get_scale(q))


class NaNGradOnMaskedRowAttention(NaiveAttention):
    """Zeros in the forward of a fully masked row, but NaN gradients (the torch.where trap)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        scores = q @ k.transpose(-2, -1) * self.get_scale(q)
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if causal:
            keep = causal_keep(q.shape[-2], k.shape[-2], device=q.device)
        if key_padding_mask is not None:
            keep = keep & key_padding_mask[:, None, None, :]
        additive = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
        weights = torch.softmax(scores + additive, -1)
        weights = torch.where(keep.any(-1, keepdim=True), weights, torch.zeros((), dtype=q.dtype))
        return weights @ v


class ClaimsCrossAttention(NaiveAttention):
    """Claims cross-attention but builds an (L, L) bias, so L != S crashes."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        L = q.shape[-2]
        bias = torch.zeros(L, L, dtype=q.dtype, device=q.device)
        scores = q @ k.transpose(-2, -1) * self.get_scale(q) + bias
        if causal:
            scores = scores.masked_fill(~causal_keep(L, L, device=q.device), float("-inf"))
        return torch.softmax(scores, -1) @ v


class NoRefusalAttention(NaiveAttention):
    """Declares no key padding, skips the base class's validation and ignores the mask."""

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None, attn_mask=None):
        return naive_attention(q, k, v, causal=causal, scale=self.get_scale(q))


class WrongScaleAttention(NaiveAttention):
    """Claims to be exact but scales by 1/D instead of 1/sqrt(D)."""

    def get_scale(self, q):
        return 1.0 / q.shape[-1]


class WrongDtypeAttention(NaiveAttention):
    """Always returns float32."""

    def _forward(self, q, k, v, **kw):
        return super()._forward(q, k, v, **kw).float()


class BatchMixingAttention(NaiveAttention):
    """Centres the values with their mean over the whole batch."""

    def _forward(self, q, k, v, **kw):
        return super()._forward(q, k, v - v.mean(dim=(0, 2), keepdim=True), **kw)


class UniformAttention(NaiveAttention):
    """An "approximation" that averages the visible values: far outside any honest bound."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        return naive_attention(q * 0, k, v, causal=causal, key_padding_mask=key_padding_mask)


class SlightlyNoisyAttention(NaiveAttention):
    """A fair approximation: exact attention plus a fixed 0.1 % perturbation (within bound 0.01)."""

    def _forward(self, q, k, v, **kw):
        out = super()._forward(q, k, v, **kw)
        return out * (1 + 1e-3 * torch.cos(torch.arange(out.shape[-1], dtype=out.dtype, device=out.device)))


class FeaturesNotInBufferAttention(NaiveAttention):
    """Random features drawn at build time but kept as a plain attribute, so state_dict loses them."""

    def __init__(self, *, num_heads=None, head_dim=None, scale=None, backend="auto"):
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.features = torch.randn(head_dim, head_dim, dtype=torch.float64)

    def _forward(self, q, k, v, **kw):
        f = self.features.to(q.dtype)
        return super()._forward(q @ f, k @ f, v, **kw)


class NoOpResetAttention(NaiveAttention):
    """Seeded random features in a buffer, and a ``reset_parameters`` that sets nothing: after the meta-device
    recipe (``to_empty``) it computes with uninitialised memory."""

    def __init__(self, *, num_heads=None, head_dim=None, scale=None, backend="auto"):
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("features", torch.randn(head_dim, head_dim, dtype=torch.float64, generator=g,
                                                     device="cpu").to(torch.get_default_device()))

    def reset_parameters(self):
        pass

    def _forward(self, q, k, v, **kw):
        f = self.features.to(q.dtype)
        return super()._forward(q @ f, k @ f, v, **kw)


class TraceCacheAttention(NaiveAttention):
    """Keeps a per-(length, dtype) weight made on its first call, without :func:`attnkit.caching.outside_trace`:
    when that call is a ``torch.export`` trace, the cache keeps a fake tensor, and the next eager call fails."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        cache = self.__dict__.setdefault("_weights", {})
        key = (q.shape[-2], q.dtype)
        if key not in cache:
            cache[key] = torch.ones(q.shape[-2], 1, dtype=q.dtype, device=q.device)
        return super()._forward(q * cache[key], k, v, causal=causal, key_padding_mask=key_padding_mask,
                                attn_mask=attn_mask)


class ValueBranchAttention(NaiveAttention):
    """Declares ``Capabilities.export`` and branches in Python on the values of its input (a clamp taken only
    when needed): ``torch.export`` cannot trace it."""

    def _forward(self, q, k, v, **kw):
        if bool((q.abs() > 1e4).any()):
            q = q.clamp(-1e4, 1e4)
        return super()._forward(q, k, v, **kw)


class PaddingShortcutAttention(NaiveAttention):
    """Declares key padding among ``Capabilities.export_masks`` and drops the mask when it pads nothing, checked
    on the mask's values: a branch on an input of the exported program, which ``torch.export`` cannot take."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if key_padding_mask is not None and bool(key_padding_mask.all()):
            key_padding_mask = None
        return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)


class LengthHintAttention(NaiveAttention):
    """Declares ``Capabilities.export_dynamic`` and scales its queries by a factor of the length read as a
    plain int from a symbolic size's hint (a careless way to avoid specialising): the program keeps the
    example's length, right there and wrong at every other length."""

    def _forward(self, q, k, v, **kw):
        L = q.shape[-2]
        hint = L.node.hint if isinstance(L, torch.SymInt) else L
        return super()._forward(q * (1.0 + 1.0 / hint), k, v, **kw)


class LengthSpecialisingAttention(NaiveAttention):
    """Declares ``Capabilities.export_dynamic`` and builds a table from the length as a Python int: the export
    specialises the length, and ``torch.export`` refuses the dynamic dimension."""

    def _forward(self, q, k, v, **kw):
        ramp = torch.arange(int(q.shape[-2]), dtype=q.dtype, device=q.device)
        return super()._forward(q + 0 * ramp[:, None], k, v, **kw)


class ExportDetachAttention(NaiveAttention):
    """Declares ``Capabilities.export_dynamic`` and detaches the values while exporting (a careless way to keep a
    custom kernel's autograd out of the trace): the program's outputs are right, its gradient of v is None."""

    def _forward(self, q, k, v, **kw):
        return super()._forward(q, k, v.detach() if torch.compiler.is_exporting() else v, **kw)


class TransformCacheAttention(NaiveAttention):
    """Declares ``export`` and ``grad`` and keeps a per-shape scale made from q in a cache every module shares,
    careful under ``torch.export`` (nothing kept while exporting) but not under ``torch.func`` (no
    ``attnkit.caching.may_keep``): a call under ``torch.func.grad`` keeps the transform's wrapper, and a later
    program holding it as a constant fails to save."""

    _SCALES: dict[Any, Tensor] = {}

    def _forward(self, q, k, v, **kw):
        key = (tuple(q.shape), q.dtype)
        scale = self._SCALES.get(key)
        if scale is None:
            scale = q.detach().new_ones(q.shape[-1])
            if not torch.compiler.is_exporting():
                self._SCALES[key] = scale
        return super()._forward(q * scale, k, v, **kw)


class StridesIgnoredAttention(NaiveAttention):
    """Reads k's memory as if it were contiguous (what a kernel handed ``k.data_ptr()`` without its strides
    does): right on contiguous inputs, wrong on a transposed view."""

    def _forward(self, q, k, v, **kw):
        dense = torch.empty(k.shape, dtype=k.dtype).stride()
        if k.storage_offset() == 0 and k.untyped_storage().nbytes() >= k.numel() * k.element_size():
            k = k.as_strided(k.shape, dense)
        return super()._forward(q, k, v, **kw)


class NondeterministicAttention(NaiveAttention):
    """Redraws a random perturbation on every call, even in eval mode."""

    def _forward(self, q, k, v, **kw):
        return super()._forward(q + 0.1 * torch.randn_like(q), k, v, **kw)


class BackendMismatchAttention(NaiveAttention):
    """Offers a second backend ('fake') whose result is 1 % off the torch path."""

    def _forward(self, q, k, v, **kw):
        out = super()._forward(q, k, v, **kw)
        return out * 1.01 if self.resolve_backend(q, k, v) == "fake" else out


class DetachedKeysAttention(NaiveAttention):
    """Cuts the gradient to the keys: the forward is right, the backward is not."""

    def _forward(self, q, k, v, **kw):
        return super()._forward(q, k.detach(), v, **kw)


class _MaskFreeBackward(torch.autograd.Function):
    """Forward honours the padding; backward recomputes without it (a custom-kernel bug)."""

    @staticmethod
    def forward(ctx, q, k, v, kpm, causal, scale):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        return naive_attention(q, k, v, causal=causal, key_padding_mask=kpm, scale=scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = naive_attention(q, k, v, causal=ctx.causal, scale=ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
        return gq, gk, gv, None, None, None


class PaddingGradLeakAttention(NaiveAttention):
    """Right forward, but its backward ignores key padding (a custom-kernel bug); the base zeroes the
    padded keys, so the padded gradients stay 0 and the leak shows in the other gradients."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if key_padding_mask is None:
            return super()._forward(q, k, v, causal=causal, key_padding_mask=None, attn_mask=attn_mask)
        return _MaskFreeBackward.apply(q, k, v, key_padding_mask, causal, self.get_scale(q))


class BypassPaddingGradLeakAttention(NaiveAttention):
    """Overrides ``forward`` (so the base does not zero padded keys) and its backward ignores the padding:
    padded keys get gradients."""

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None, **kw):
        if key_padding_mask is None or kw:
            return super().forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **kw)
        self._check_qkv(q, k, v, "forward")
        return _MaskFreeBackward.apply(q, k, v, key_padding_mask, causal, self.get_scale(q))


# ------------------------------------------------------------ contract 2 faults
class MeanOfValuesAttention(Attention):
    """Claims to be exact softmax; returns the mean of the visible values (uniform weights).

    It honours every mask (so causality, padding and mask checks pass), has
    the right shape and is finite: only the reference catches it.
    """

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, ctx: CallContext) -> Tensor:
        keep = ctx.dense_keep()
        B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        w = torch.ones(B, H, L, S, dtype=q.dtype, device=q.device)
        if keep is not None:
            w = w * keep
        w = w / w.sum(-1, keepdim=True).clamp_min(1)
        return w @ v


class LocalAttention(Attention):
    """Softmax over a band of keys: the query at position p sees keys at p - window ... p + window.

    A correct non-softmax mechanism with its own reference (:func:`local_reference`);
    honours causal, key padding and sliding-window masks (``&``-ed with its band).

    Args:
        window: keys on each side of the query.
        num_heads: unused. head_dim: unused. scale: multiplier of q·k. backend: only "torch".
    """

    _reach = 0  # the broken variant adds one key

    def __init__(self, *, window: int = 2, num_heads: int | None = None, head_dim: int | None = None,
                 scale: float | None = None, backend: str = "auto") -> None:
        super().__init__(num_heads=num_heads, head_dim=head_dim, scale=scale, backend=backend)
        self.window = window

    def _attend(self, q, k, v, ctx):
        reach = self.window + self._reach
        band = M.sliding_window(reach, reach)
        m = band if ctx.mask is None else ctx.mask & band
        return masked_softmax_attention(q, k, v, keep=m.dense(ctx.geometry), bias=m.bias(ctx.geometry, q.dtype),
                                        scale=ctx.scale)


def local_reference(attn, q, k, v, *, mask, positions):
    """The reference of :class:`LocalAttention`: the dense masked softmax over the band of ``attn.window``."""
    band = M.sliding_window(attn.window, attn.window)
    return naive_attention(q, k, v, mask=band if mask is None else mask & band, positions=positions,
                           scale=attn.scale)


#: the band compares positions, so the mechanism declares positions (and honours ``positions=``)
LOCAL_CAPS = Capabilities(mask_kinds=("causal", "key_padding", "sliding_window"), positions=True)


class OffByOneWindowAttention(LocalAttention):
    """Local attention whose band is one key too wide on each side (window + 1)."""

    _reach = 1


class OneBackendIgnoresPaddingAttention(Attention):
    """Softmax attention with a second backend ('kitfake', assumed available) that drops key padding."""

    def _attend(self, q, k, v, ctx):
        m = ctx.rest("key_padding") if ctx.backend == "kitfake" else ctx.mask
        if m is None:
            return masked_softmax_attention(q, k, v, scale=ctx.scale)
        return masked_softmax_attention(q, k, v, keep=m.dense(ctx.geometry), bias=m.bias(ctx.geometry, q.dtype),
                                        scale=ctx.scale)


class IgnoresWindowAttention(Attention):
    """Declares sliding-window masks, honours only causal and key padding (drops the window)."""

    def _attend(self, q, k, v, ctx):
        return naive_attention(q, k, v, causal=ctx.causal, key_padding_mask=ctx.key_padding_mask, scale=ctx.scale)


class WrongPrefixStreamingAttention(NaiveAttention):
    """Exact streaming whose KV cache silently keeps only the last 4 positions (the wrong prefix)."""

    def _step(self, q, k, v, state):
        out, new = super()._step(q, k, v, state)
        return out, {"k": new["k"][:, :, -4:], "v": new["v"][:, :, -4:]}


class DetachedCacheAttention(NaiveAttention):
    """Exact streaming whose KV cache is detached from the graph while the spec says gradients flow
    through states (``state_detached=False``): segment-by-segment training gets wrong gradients."""

    def _step(self, q, k, v, state):
        out, new = super()._step(q, k, v, state)
        return out, {"k": new["k"].detach(), "v": new["v"].detach()}


class NaNOnPaddedKeysAttention(NaiveAttention):
    """Overrides ``forward`` and masks padded keys itself, bypassing the base's zeroing:
    NaN values at padded keys leak through ``0 * NaN`` in ``weights @ v``."""

    def forward(self, q, k, v, *, causal=False, key_padding_mask=None, **kw):
        if key_padding_mask is None or kw:
            return super().forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, **kw)
        self._check_qkv(q, k, v, "forward")
        return naive_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=self.get_scale(q))


class RowMaxOnEmptyAttention(NaiveAttention):
    """Overrides ``forward`` with a hand-written stabiliser (a row max over the keys) that runs before the
    base's handling of empty sequences: S = 0 raises."""

    def forward(self, q, k, v, **kw):
        (q @ k.transpose(-2, -1)).amax(-1)
        return super().forward(q, k, v, **kw)


class SmallHeadDimAttention(NaiveAttention):
    """Indexes feature 3 of q for a "norm" (the kit's fixed shapes have D = 8 or 16): D < 4 raises IndexError.

    Only the fuzz check draws other head dims."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        q[..., 3]  # noqa: B018 - the fault: assumes D >= 4
        return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)


class QueryMixingAttention(NaiveAttention):
    """Normalises each query by the norm of all queries of its (b, h): a NaN query poisons every row."""

    def _forward(self, q, k, v, **kw):
        q = q / q.norm(dim=(2, 3), keepdim=True) * q.shape[2] ** 0.5
        return super()._forward(q, k, v, **kw)


class LambdaHoldingAttention(NaiveAttention):
    """Keeps a lambda on the module: deepcopy works, pickle and torch.save of the module fail."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.activation = lambda x: x

    def _forward(self, q, k, v, **kw):
        return super()._forward(self.activation(q), k, v, **kw)


class UnvalidatedStateAttention(NaiveAttention):
    """Overrides ``step`` and uses any state it is given: a state of another batch, dtype, mechanism or
    configuration is accepted silently."""

    def step(self, q, k, v, state):
        data = state.data if isinstance(state, AttentionState) else {"k": None, "v": None}
        out, new = self._step(q, k, v, data)
        return out, AttentionState(self.state_owner(), q.shape[0], q.dtype, q.device, new)


class UnderflowingExpAttention(NaiveAttention):
    """Softmax written as ``exp(score - 4 |q_i|^2) / sum``: a per-row shift that cancels in exact arithmetic,
    fine for unit-scale inputs, but every weight of a row underflows once q is scaled by 10 (all-zero rows,
    the failure of unstabilised random features). Its reference is softmax attention (:func:`softmax_reference`)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        scores = q @ k.transpose(-2, -1) * self.get_scale(q)
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if causal:
            keep = causal_keep(q.shape[-2], k.shape[-2], device=q.device)
        keep = keep.expand_as(scores)
        if key_padding_mask is not None:
            keep = keep & key_padding_mask[:, None, None, :]
        w = torch.where(keep, torch.exp(scores - 4 * (q * q).sum(-1, keepdim=True)), torch.zeros(()))
        den = w.sum(-1, keepdim=True)
        return torch.where(den == 0, torch.zeros(()), w @ v / torch.where(den == 0, torch.ones(()), den))


class InferenceCacheAttention(NaiveAttention):
    """Keeps a per-(device, dtype) factor made on its first call, without :func:`attnkit.caching.kept_tensors`: made
    under ``inference_mode``, it is an inference tensor the next training call cannot save for backward."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        cache = self.__dict__.setdefault("_ones", {})
        key = (q.device, q.dtype)
        if key not in cache:
            cache[key] = torch.ones((), dtype=q.dtype, device=q.device)
        return super()._forward(q * cache[key], k, v, causal=causal, key_padding_mask=key_padding_mask,
                                attn_mask=attn_mask)


class AutocastBypassAttention(NaiveAttention):
    """Overrides ``forward`` to turn autocast off around the base's: float32 inputs stay float32 under autocast
    (SDPA, and the contract, cast them to the autocast dtype)."""

    def forward(self, q, k, v, **kw):
        with torch.autocast(q.device.type, enabled=False):
            return super().forward(q, k, v, **kw)


def _softmax_grads(q, k, v, p, g, scale):
    """Gradients of ``softmax(q kᵀ·scale) v`` for q, k, v given its probabilities ``p`` and incoming ``g``."""
    dv = p.transpose(-1, -2) @ g
    dp = g @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.transpose(-1, -2) @ q, dv


class _SavedProbs(torch.autograd.Function):
    """``softmax(q kᵀ·scale) v`` whose backward reads the probabilities saved from the forward (right to first
    order); under ``create_graph`` they are constants, so second derivatives miss terms, silently."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        p = torch.softmax((q @ k.transpose(-1, -2)) * scale, -1)
        ctx.save_for_backward(q, k, v)
        ctx.p, ctx.scale = p.detach(), scale
        return p @ v

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        return (*_softmax_grads(q, k, v, ctx.p, g, ctx.scale), None)


class _DoubleUnpack(torch.autograd.Function):
    """``softmax(q kᵀ·scale) v`` with a right backward that reads ``ctx.saved_tensors`` twice (once for a device,
    as the kernelized plugin's linear product did): torch.utils.checkpoint allows one unpack."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return torch.softmax((q @ k.transpose(-1, -2)) * scale, -1) @ v

    @staticmethod
    def backward(ctx, g):
        with torch.device(ctx.saved_tensors[0].device):
            q, k, v = ctx.saved_tensors
            p = torch.softmax((q @ k.transpose(-1, -2)) * ctx.scale, -1)
            return (*_softmax_grads(q, k, v, p, g, ctx.scale), None)


class _FunctionAttention(NaiveAttention):
    """Softmax attention whose plain case (not causal, no mask) runs :attr:`function`, a custom autograd.Function
    ``(q, k, v, scale)``; masked cases run the correct base."""

    function: Any = None

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if causal or key_padding_mask is not None or attn_mask is not None:
            return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return type(self).function.apply(q, k, v, self.get_scale(q))


class SavedProbsAttention(_FunctionAttention):
    """Right outputs and first derivatives; second derivatives through its backward silently wrong."""

    function = _SavedProbs


class DoubleUnpackAttention(_FunctionAttention):
    """Right outputs and gradients; fails under activation checkpointing (its backward unpacks twice)."""

    function = _DoubleUnpack


class OldStyleFunctionAttention(SavedProbsAttention):
    """Declares ``torch.func.grad`` while its kernel is an autograd.Function without ``setup_context``."""


class TrainingOnlyFunctionAttention(NaiveAttention):
    """Declares ``torch.func.grad``; in training mode (only) its plain case runs an autograd.Function without
    ``setup_context`` (as routing's commitment loss did): right under autograd, refused by ``torch.func``."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if self.training and not causal and key_padding_mask is None and attn_mask is None:
            return _SavedProbs.apply(q, k, v, self.get_scale(q))
        return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)


class LastQueryNormAttention(NaiveAttention):
    """Declares ``torch.func.grad`` and keeps the last call's mean query norm for reports (as dynamic-span kept its
    spans): after a call under a transform the module holds the transform's wrapper."""

    def _forward(self, q, k, v, **kw):
        self.last_query_norm = q.detach().norm(dim=-1).mean()
        return super()._forward(q, k, v, **kw)


class CompactingPaddingAttention(NaiveAttention):
    """Declares ``torch.func.vmap``; without causal or attn_mask it removes each row's padded keys by indexing
    with ``key_padding_mask.nonzero()`` (as poolingformer does) and does not refuse a mask batched by vmap:
    per-sample masks fail inside vmap with PyTorch's error."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if key_padding_mask is None or causal or attn_mask is not None:
            return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        outs = []
        for b in range(q.shape[0]):
            idx = key_padding_mask[b].nonzero().flatten()
            rows = (q[b:b + 1], k[b:b + 1, :, idx], v[b:b + 1, :, idx])
            outs.append(naive_attention(*rows, scale=self.get_scale(q)) if idx.numel() else
                        v.new_zeros(1, *q.shape[1:3], v.shape[-1]))
        return torch.cat(outs)


class AllowAllShortcutAttention(NaiveAttention):
    """Declares ``torch.func.vmap``; drops a bool ``attn_mask`` that allows every pair, deciding with
    ``bool(attn_mask.all())``: a branch on the mask's values, which vmap refuses for a per-sample mask (core
    attnkit's additive-mask checks did the same until session 52)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if attn_mask is not None and attn_mask.dtype == torch.bool and bool(attn_mask.all()):
            attn_mask = None
        return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)


class FunctorchOnlyCheckAttention(NaiveAttention):
    """Declares ``grad`` and ``jvp``; takes its fused path unless q is a ``torch.func`` wrapper (it checks the
    tensor itself instead of following the backend it was given): dual tensors of ``torch.autograd.forward_ad``
    then reach a function without a forward-mode rule (the numba operators of attnkit's plugins dropped the
    tangent there until session 53)."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        if (key_padding_mask is None and attn_mask is None
                and not torch._C._functorch.is_functorch_wrapped_tensor(q)):
            # a "fused kernel": right without padding, and, as every custom function without a jvp, no forward-mode rule
            return _MaskFreeBackward.apply(q, k, v, None, causal, self.get_scale(q))
        return super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)


class PenalisedAttention(NaiveAttention):
    """Correct, with an auxiliary loss in the graph (the mean square of its output), recorded inside ``_forward``."""

    def _forward(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        out = super()._forward(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        self.record_aux_loss("penalty", self._penalty(out))
        return out

    def _penalty(self, out):
        return out.square().mean()


class LateAuxAttention(NaiveAttention):
    """Records its auxiliary loss after the base class's ``forward`` returned: the record is not tied to the
    forward's output, so a step that does not collect leaves it for the next step's loss."""

    def forward(self, q, k, v, **kw):
        out = super().forward(q, k, v, **kw)
        self.record_aux_loss("penalty", out.square().mean())
        return out


def softmax_reference(attn, q, k, v, *, mask, positions):
    """Softmax attention with the module's scale (the reference of :class:`UnderflowingExpAttention`)."""
    return naive_attention(q, k, v, mask=mask, positions=positions, scale=attn.get_scale(q))


@dataclass(frozen=True)
class BrokenCase:
    """How to register one broken class and which check must catch it (message regex)."""

    cls: type
    name: str
    check: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)


CASES: list[BrokenCase] = [
    # the five of the first issue
    BrokenCase(LeakyFutureAttention, "broken-leak", "causality", "leaks the future",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(IgnoresPaddingAttention, "broken-ignores-padding", "key_padding",
               "key_padding_mask is not honoured", {"exact": True, "capabilities": BASIC}),
    BrokenCase(NaNOnMaskedRowAttention, "broken-nan-row", "fully_masked_rows", "non-finite",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(StreamingMismatchAttention, "broken-streaming", "streaming",
               r"chunk=1.*differ from forward\(causal=True\)",
               {"exact": True, "capabilities": Capabilities(streaming="exact")}),
    BrokenCase(ClaimsAttnMaskAttention, "broken-claims-mask", "attn_mask", "attn_mask is not honoured",
               {"exact": True, "capabilities": Capabilities(attn_mask=True)}),
    # more faults, one per remaining check
    BrokenCase(ClaimsStreamingAttention, "broken-claims-streaming", "streaming",
               "init_state/step raised NotImplementedError",
               {"exact": True, "capabilities": Capabilities(streaming="exact")}),
    BrokenCase(NaNGradOnMaskedRowAttention, "broken-nan-grad", "fully_masked_rows",
               r"gradient|\.grad has .* non-finite", {"exact": True, "capabilities": BASIC}),
    BrokenCase(ClaimsCrossAttention, "broken-claims-cross", "cross_attention", "raised RuntimeError",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(NoRefusalAttention, "broken-no-refusal", "refusals", "accepted silently",
               {"exact": True, "capabilities": Capabilities(key_padding_mask=False)}),
    BrokenCase(WrongScaleAttention, "broken-scale", "reference", "output vs reference",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(StridesIgnoredAttention, "broken-strides", "layouts",
               r"q, k, v transposed from \(B, L, H, D\): output vs the same values contiguous",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(WrongDtypeAttention, "broken-dtype", "shapes_dtypes", "output dtype torch.float32",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(BatchMixingAttention, "broken-batch-mixing", "batch_independence", "batch element 0",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(UniformAttention, "broken-error-bound", "error_bound", "exceeds the declared error_bound",
               {"exact": False, "error_bound": 0.01, "capabilities": BASIC}),
    BrokenCase(FeaturesNotInBufferAttention, "broken-state-dict", "state_dict", "not a buffer",
               {"exact": False, "capabilities": BASIC}),
    BrokenCase(NondeterministicAttention, "broken-nondeterministic", "determinism", "second call",
               {"exact": False, "capabilities": BASIC}),
    BrokenCase(BackendMismatchAttention, "broken-backend", "backends", "backend='fake' vs 'torch'",
               {"exact": True, "capabilities": Capabilities(backends=("torch", "fake"))}),
    BrokenCase(BypassPaddingGradLeakAttention, "broken-padding-grad", "gradients", "at padded key positions",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(NaNInTrainingAttention, "broken-nan-training", "training_mode",
               r"training mode, call 1: output has \d+ non-finite", {"exact": True, "capabilities": BASIC}),
    BrokenCase(InferenceCacheAttention, "broken-inference-cache", "inference_mode",
               r"training mode after inference_mode calls.*Inference tensors cannot be saved for backward",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(AutocastBypassAttention, "broken-autocast", "autocast",
               r"torch.autocast\('cpu', dtype=torch.bfloat16\): output dtype torch.float32, expected torch.bfloat16",
               {"exact": True, "capabilities": Capabilities(dtypes=("float32", "float64", "bfloat16"))}),
    BrokenCase(SavedProbsAttention, "broken-double-backward", "double_backward",
               r"second derivatives are wrong: the directional derivative",
               {"exact": True, "capabilities": Capabilities(causal=False)}),
    BrokenCase(OldStyleFunctionAttention, "broken-func-transforms", "func_transforms",
               r"under torch.func.grad \(declared in Capabilities.func_transforms \('grad',\)\) raised RuntimeError",
               {"exact": True, "capabilities": Capabilities(causal=False, func_transforms=("grad",))}),
    BrokenCase(TrainingOnlyFunctionAttention, "broken-func-training", "func_transforms",
               r"training mode, torch.func.grad with the buffers passed in \(functional_call\) \(grad declared in "
               r"Capabilities.func_transforms\) raised RuntimeError",
               {"exact": True, "capabilities": Capabilities(causal=False, func_transforms=("grad",))}),
    BrokenCase(LastQueryNormAttention, "broken-func-kept", "func_transforms",
               r"under torch.func.grad: afterwards the module keeps a tensor made under the transform in "
               r"LastQueryNormAttention.last_query_norm",
               {"exact": True, "capabilities": Capabilities(func_transforms=("grad",))}),
    BrokenCase(CompactingPaddingAttention, "broken-vmap-masks", "func_transforms",
               r"under torch.func.vmap with the key_padding_mask batched too \(vmap declared in "
               r"Capabilities.func_transforms\) raised RuntimeError",
               {"exact": True, "capabilities": Capabilities(func_transforms=("vmap",))}),
    BrokenCase(FunctorchOnlyCheckAttention, "broken-dual-tensors", "func_transforms",
               r"with dual tensors \(torch.autograd.forward_ad, requires_grad=False\) \(jvp declared\) raised "
               r"NotImplementedError",
               {"exact": True, "capabilities": Capabilities(func_transforms=("grad", "jvp"))}),
    BrokenCase(AllowAllShortcutAttention, "broken-vmap-attn-mask", "func_transforms",
               r"attn_mask=<bool parity \(B, H, L, S\)>, .*under torch.func.vmap with the attn_mask batched too "
               r"\(vmap declared in Capabilities.func_transforms\) raised RuntimeError",
               {"exact": True, "capabilities": Capabilities(attn_mask=True, func_transforms=("vmap",))}),
    BrokenCase(TraceCacheAttention, "broken-trace-cache", "export",
               r"eager after torch.export, causal=\w+, no mask input: the output is a fake tensor",
               {"exact": True, "capabilities": Capabilities(export=True)}),
    BrokenCase(ValueBranchAttention, "broken-export-branch", "export",
               r"torch.export.export of a fresh module, causal=\w+, no mask input \(declared in Capabilities.export\) "
               r"raised GuardOnDataDependentSymNode", {"exact": True, "capabilities": Capabilities(export=True)}),
    BrokenCase(PaddingShortcutAttention, "broken-export-padding", "export",
               r"causal=True, a key_padding mask as an input \(declared in Capabilities.export_masks\) raised",
               {"exact": True, "capabilities": Capabilities(export=True)}),
    BrokenCase(TransformCacheAttention, "broken-transform-cache", "export",
               r"torch.export.save / load of the program, causal=\w+, no mask input, after torch.func.grad, the module "
               r"that ran it, raised \w+: Cannot access storage of TensorWrapper; a cache kept a tensor made "
               r"under torch.func.grad",
               {"exact": True, "capabilities": Capabilities(export=True, func_transforms=("grad",))}),
    BrokenCase(LengthHintAttention, "broken-export-length-hint", "export_dynamic",
               r"torch.export with a dynamic length \(exported at L = \d+\), causal=\w+, no mask input, "
               r"backend='torch', at length \d+: .*vs eager",
               {"exact": True, "capabilities": Capabilities(export=True, export_dynamic=("torch",))}),
    BrokenCase(ExportDetachAttention, "broken-export-detached", "export_dynamic",
               r"gradients through the dynamic-length program \(exported at L = \d+\), causal=\w+, no mask input, "
               r"backend='torch', at length \d+: dv is None in the program, a tensor in eager",
               {"exact": True, "capabilities": Capabilities(export=True, export_dynamic=("torch",))}),
    BrokenCase(LengthSpecialisingAttention, "broken-export-specialised", "export_dynamic",
               r"torch.export.export with a dynamic length \(1..\d+\), causal=False, no mask input, "
               r"backend='torch' \(declared in Capabilities.export_dynamic \('torch',\)\) raised UserError: "
               r"Constraints violated",
               {"exact": True, "capabilities": Capabilities(export=True, export_dynamic=("torch",))}),
    BrokenCase(NoOpResetAttention, "broken-meta-init", "meta_init",
               r"state_dict entry 'features' after to_empty \+ reset_parameters\(\)",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(DoubleUnpackAttention, "broken-checkpointing", "checkpointing",
               r"under torch.utils.checkpoint\(use_reentrant=False\): backward raised CheckpointError",
               {"exact": True, "capabilities": Capabilities(causal=False)}),
    BrokenCase(LateAuxAttention, "broken-late-aux", "aux_losses",
               r"without collecting, \['penalty'\] stayed recorded",
               {"exact": True, "capabilities": BASIC, "aux_losses": {"penalty": 1.0}}),
    BrokenCase(DetachedKeysAttention, "broken-gradcheck", "gradcheck", r"gradcheck .* failed .*Jacobian mismatch",
               {"exact": True, "capabilities": BASIC}),
    # contract 2: reference agreement, padding without the perturbation trick, bad inputs, streaming
    BrokenCase(MeanOfValuesAttention, "broken-mean-of-v", "reference", "output vs reference",
               {"exact": True, "capabilities": Capabilities(attn_mask=True, causal_cross=True)}),
    BrokenCase(OffByOneWindowAttention, "broken-window", "reference", r"output vs reference",
               {"exact": False, "reference": local_reference, "capabilities": LOCAL_CAPS}),
    BrokenCase(OneBackendIgnoresPaddingAttention, "broken-one-backend", "reference",
               r"backend='kitfake', causal=\w+, key_padding_mask=.* output vs reference",
               {"exact": True, "capabilities": Capabilities(backends=("torch", "kitfake"))}),
    BrokenCase(PaddingGradLeakAttention, "broken-padding-grad-base", "reference",
               r"key_padding_mask=.*gradient of [qkv] vs reference", {"exact": True, "capabilities": BASIC}),
    BrokenCase(IgnoresWindowAttention, "broken-ignores-window", "mask_objects", "the mask is not honoured",
               {"exact": True, "capabilities": LOCAL_CAPS}),
    BrokenCase(WrongPrefixStreamingAttention, "broken-wrong-prefix", "streaming",
               r"chunk=1.*step outputs differ from forward\(causal=True\)",
               {"exact": True, "capabilities": Capabilities(streaming="exact")}),
    BrokenCase(DetachedCacheAttention, "broken-detached-state", "streaming",
               r"gradients through forward\(state=\.\.\., return_state=True\) differ",
               {"exact": True, "capabilities": Capabilities(streaming="exact")}),
    BrokenCase(UnvalidatedStateAttention, "broken-state-validation", "state_validation",
               r"step\(.*a state for batch size 3.*accepted silently",
               {"exact": True, "capabilities": Capabilities(streaming="exact")}),
    BrokenCase(LambdaHoldingAttention, "broken-lambda", "serialisation",
               r"pickle.loads\(pickle.dumps\(module\)\) raised", {"exact": True, "capabilities": BASIC}),
    BrokenCase(RowMaxOnEmptyAttention, "broken-empty", "empty_sequences", r"S=0.*raised",
               {"exact": True, "capabilities": BASIC}),
    BrokenCase(NaNOnPaddedKeysAttention, "broken-nan-padded", "padded_values",
               r"padded k and v = nan.*non-finite", {"exact": True, "capabilities": BASIC}),
    BrokenCase(QueryMixingAttention, "broken-query-mixing", "nan_queries", "other output rows changed",
               {"exact": False, "capabilities": Capabilities(causal=False)}),
    BrokenCase(UnderflowingExpAttention, "broken-underflow", "scaled_inputs",
               r"scaled by 10: .* output rows are all zeros",
               {"exact": False, "reference": softmax_reference, "capabilities": BASIC}),
    BrokenCase(SmallHeadDimAttention, "broken-small-head-dim", "fuzz",
               r"(?s)forward raised IndexError.*reproduce \(shrunk by hypothesis\).*FuzzCase\(.*D=[123],",
               {"exact": True, "capabilities": BASIC}),
]
