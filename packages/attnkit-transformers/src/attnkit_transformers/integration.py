"""Register attnkit mechanisms in transformers' ``AttentionInterface`` and run them there.

For every name registered here, two entries are made in transformers:

* ``AttentionInterface["attnkit:<name>"]``: an attention function
  ``(module, query, key, value, attention_mask, scaling, dropout, **kwargs) ->
  (out (B, L, H, E), None)``;
* ``AttentionMaskInterface["attnkit:<name>"]``: transformers' ``sdpa`` mask
  builder. Without a mask builder transformers hands a custom attention
  function **no mask at all** (``masking_utils._preprocess_mask_arguments``
  returns early), which would drop padding silently.

The attention function converts the mask (:mod:`attnkit_transformers.masks`),
repeats key/value heads for grouped-query attention, builds one attnkit module
per (transformers attention module, name) on first use and keeps it there as a
submodule (so its parameters train, save and move with the model), and decodes
with a KV cache only where that gives the full forward's result.
"""

from __future__ import annotations

import math
import threading
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import attnkit
from attnkit import InvalidInputError, UnsupportedFeatureError
from attnkit.registry import Registry, default_registry

from .masks import Converted, convert

#: prefix of every name this package registers in transformers
PREFIX = "attnkit:"
#: model-config attribute holding build options (``{"window": 256}``, or ``{"local": {"window": 256}, ...}``)
CONFIG_OPTIONS = "attnkit_options"
#: model-config attribute holding the seed mechanisms are built under (default 0)
CONFIG_SEED = "attnkit_seed"
#: attribute of a transformers attention module holding its attnkit modules (an ``nn.ModuleDict``)
MODULES_ATTRIBUTE = "attnkit_mechanisms"
#: kwargs transformers may pass that no attnkit mechanism honours; refused when set
_REFUSED_KWARGS = {
    "softcap": "attention-logit soft-capping (tanh)",
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias (T5-style)",
}

_LOCK = threading.Lock()


@dataclass(frozen=True)
class Entry:
    """One name registered in transformers.

    Attributes:
        key: the transformers name (``attnkit:local-256``).
        mechanism: the attnkit name (``local``).
        options: build options given to :func:`register`.
        registry: the attnkit registry to build from.
    """

    key: str
    mechanism: str
    options: Mapping[str, Any] = field(default_factory=dict)
    registry: Registry | None = None

    @property
    def spec(self) -> attnkit.AttentionSpec:
        return (self.registry or default_registry()).resolve(self.mechanism)


_ENTRIES: dict[str, Entry] = {}


def _interfaces() -> tuple[Any, Any]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionInterface, AttentionMaskInterface


def register(mechanism: str | None = None, /, *, name: str | None = None, registry: Registry | None = None,
             **options: Any) -> list[str]:
    """Make attnkit mechanisms available as ``attn_implementation="attnkit:<name>"``.

    ``register()`` registers every mechanism in the attnkit registry under
    ``attnkit:<name>``; ``register("local", window=256, name="attnkit:local-256")``
    registers one mechanism with build options under a name of your choice
    (``functools.partial`` style). Registering a name again replaces it.

    Args:
        mechanism: an attnkit name (alias, ``family/name`` or ``dist:name``); None = all.
        name: the transformers name (default ``"attnkit:" + the mechanism's name``);
            only with ``mechanism``.
        registry: the attnkit registry (default: the process-wide one).
        **options: build options of ``mechanism`` (``attnkit describe NAME`` lists them);
            the model config's ``attnkit_options`` are merged over them.

    Returns:
        the transformers names registered.

    Raises:
        InvalidInputError: options or ``name`` without a mechanism, an empty name,
            or an option the mechanism does not take.
        UnknownAttentionError: ``mechanism`` is not registered in attnkit.
    """
    reg = registry or default_registry()
    if mechanism is None:
        if options or name is not None:
            raise InvalidInputError(
                f"register: options {sorted(options)} and name= apply to one mechanism, got no mechanism; "
                "call register('local', window=256, name='attnkit:local-256')" if options else
                f"register: name={name!r} names one mechanism, got no mechanism; call register('local', name=...)")
        specs = reg.specs()
        entries = [Entry(PREFIX + s.name, s.name, {}, registry) for s in specs]
    else:
        spec = reg.resolve(mechanism)
        key = name if name is not None else PREFIX + spec.name
        if not isinstance(key, str) or not key.strip():
            raise InvalidInputError(f"register: name must be a non-empty str, got {name!r}")
        if "/" in key:
            raise InvalidInputError(
                f"register: name {key!r} contains '/', which transformers reads as a hub kernel repository; "
                "use e.g. 'attnkit:local-256'")
        if options:
            from attnkit.options import check_options

            check_options(f"register({spec.name!r})", spec.resolved_options(), dict(options), takes_extra=False)
        entries = [Entry(key, spec.name, dict(options), registry)]
    attention_interface, mask_interface = _interfaces()
    from transformers.masking_utils import sdpa_mask

    with _LOCK:
        for e in entries:
            _ENTRIES[e.key] = e
            attention_interface.register(e.key, _make_attention_function(e))
            mask_interface.register(e.key, sdpa_mask)
    return [e.key for e in entries]


def unregister(name: str) -> None:
    """Remove a name registered by :func:`register` from transformers.

    Raises:
        InvalidInputError: ``name`` was not registered by this package.
    """
    with _LOCK:
        if name not in _ENTRIES:
            raise InvalidInputError(
                f"unregister: {name!r} was not registered by attnkit_transformers; registered: {sorted(_ENTRIES)}")
        del _ENTRIES[name]
        for interface in _interfaces():
            interface._global_mapping.pop(name, None)


def registered() -> dict[str, str]:
    """``{transformers name: attnkit mechanism}`` for every name registered by :func:`register`."""
    return {k: e.mechanism for k, e in _ENTRIES.items()}


# =========================================================== the attention function
def _make_attention_function(entry: Entry) -> Any:
    def attnkit_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                                  attention_mask: Tensor | None, scaling: float | None = None,
                                  dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
        return attention_forward(entry, module, query, key, value, attention_mask, scaling=scaling,
                                 dropout=dropout, **kwargs)

    attnkit_attention_forward.__qualname__ = f"attention_forward[{entry.key}]"
    return attnkit_attention_forward


def attention_forward(entry: Entry, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """Attention as transformers calls it, computed by the attnkit mechanism of ``entry``.

    Args:
        entry: what was registered.
        module: the transformers attention module (gives ``layer_idx``, ``is_causal``, ``config``).
        query: ``(B, H, L, D)``.
        key: ``(B, Hkv, S, D)`` with ``H % Hkv == 0`` (grouped-query attention repeats key/value heads).
        value: ``(B, Hkv, S, E)``.
        attention_mask: None or ``(B|1, 1|H, L, S)`` bool / additive float.
        scaling: the multiplier of ``q·k`` (None: ``1/sqrt(D)``).
        dropout: attention-probability dropout; must be 0 (no mechanism applies it).
        **kwargs: transformers' extras; ``is_causal`` overrides ``module.is_causal``,
            ``use_cache`` enables keeping a streaming state; soft-capping, sinks
            and position biases are refused; ``output_attentions=True`` is refused.

    Returns:
        ``(out, None)`` with ``out`` of shape ``(B, L, H, E)`` (transformers' layout).

    Raises:
        UnsupportedFeatureError: a mask, dropout, kwarg or cached decoding the mechanism cannot honour.
        InvalidInputError: malformed inputs.
    """
    where = _where(entry, module)
    if dropout and dropout > 0:
        raise UnsupportedFeatureError(
            entry.mechanism, f"attention dropout={dropout} ({where})",
            "attnkit mechanisms apply no dropout to attention probabilities; set the model config's attention "
            "dropout to 0 (attention_dropout / attn_pdrop), or use attn_implementation='sdpa'")
    for k, what in _REFUSED_KWARGS.items():
        if kwargs.get(k) is not None:
            raise UnsupportedFeatureError(entry.mechanism, f"{what} ({k}=..., {where})",
                                          "the model asks for it and attnkit mechanisms do not compute it; "
                                          "use attn_implementation='eager' or 'sdpa' for this model")
    if kwargs.get("output_attentions"):
        raise UnsupportedFeatureError(
            entry.mechanism, f"output_attentions=True ({where})",
            "attnkit mechanisms return no attention weights; use attn_implementation='eager' to inspect them")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise InvalidInputError(
            f"{where}: expected query (B, H, L, D), key (B, Hkv, S, D), value (B, Hkv, S, E), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    B, H, L, D = query.shape
    hk = key.shape[1]
    if hk != H:
        if hk < 1 or H % hk:
            raise InvalidInputError(f"{where}: query heads H={H} must be a multiple of key/value heads {hk}")
        key = key.repeat_interleave(H // hk, dim=1)
        value = value.repeat_interleave(H // hk, dim=1)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    S = key.shape[2]
    conv = convert(attention_mask, is_causal=bool(is_causal), batch=B, L=L, S=S, device=query.device)
    if conv.keys < S:
        key, value, S = key[:, :, :conv.keys], value[:, :, :conv.keys], conv.keys
    attn = _mechanism(entry, module, H, D, scaling, query)
    spec = attn.spec
    cached = bool(is_causal) and L < S          # new queries after a KV cache of S - L positions
    if cached and L == 1 and spec.exact:
        # one query at the last position: causal (bottom-right) allows every key, so only padding is left
        conv = Converted(None if conv.key_padding is None else attnkit.masks.key_padding(conv.key_padding),
                         False, conv.key_padding, "key_padding" if conv.key_padding is not None else "none", S)
    if cached and not spec.exact:
        out = _decode_from_state(entry, module, attn, query, key, value, conv, where)
    else:
        try:
            out = _forward(entry, module, attn, query, key, value, conv, kwargs)
        except UnsupportedFeatureError as exc:
            raise _in_context(exc, f"{where}: transformers built a {conv.kind} mask, L={L} queries, "
                                   f"S={S} keys; use a mechanism that honours it or attn_implementation='sdpa'"
                              ) from exc
    return out.transpose(1, 2).contiguous(), None


def _in_context(exc: UnsupportedFeatureError, context: str) -> UnsupportedFeatureError:
    """The same refusal with where it happened in the model added to its reason."""
    msg = str(exc)
    head = f"{exc.implementation!r} does not support {exc.argument}"
    reason = msg[len(head):] if msg.startswith(head) else msg
    for tail in (". Installed implementations that do:", ". No installed implementation supports it"):
        if tail in reason:
            reason = reason[:reason.index(tail)]
    reason = reason.lstrip(": ").rstrip(".")
    return UnsupportedFeatureError(exc.implementation, exc.argument,
                                   f"{reason} ({context})" if reason else context, exc.supported_by)


def _where(entry: Entry, module: nn.Module) -> str:
    idx = getattr(module, "layer_idx", None)
    return f"attn_implementation={entry.key!r}, {type(module).__name__} layer {idx}"


def _forward(entry: Entry, module: nn.Module, attn: attnkit.Attention, q: Tensor, k: Tensor, v: Tensor,
             conv: Converted, kwargs: Mapping[str, Any]) -> Tensor:
    spec = attn.spec
    keep_state = (not spec.exact and spec.capabilities.streaming == "exact" and conv.causal
                  and q.shape[2] == k.shape[2] and bool(kwargs.get("use_cache")) and not torch.is_grad_enabled())
    if not keep_state:
        module.__dict__.pop("_attnkit_stream", None)
        return attn(q, k, v, mask=conv.mask)
    try:
        out, state = attn(q, k, v, mask=conv.mask, return_state=True)
    except (InvalidInputError, UnsupportedFeatureError) as exc:
        # e.g. a state that cannot start from a padded prompt: the forward itself is still fine;
        # the next cached step is refused with this reason
        module.__dict__["_attnkit_stream"] = str(exc)
        return attn(q, k, v, mask=conv.mask)
    module.__dict__["_attnkit_stream"] = _Stream(entry.key, state, k.shape[2], k[:, :, -1].clone(),
                                                 conv.key_padding)
    return out


@dataclass
class _Stream:
    """What a layer remembers between a prefill and the next decoding step of a streaming mechanism."""

    key: str
    state: attnkit.AttentionState
    length: int
    last_key: Tensor               # (B, H, D): the key at position length - 1, to recognise the same cache
    key_padding: Tensor | None     # (B, length) or None


def _decode_from_state(entry: Entry, module: nn.Module, attn: attnkit.Attention, q: Tensor, k: Tensor,
                       v: Tensor, conv: Converted, where: str) -> Tensor:
    """Cached decoding of a non-exact mechanism: continue its attnkit streaming state, or refuse."""
    spec = attn.spec
    B, _, L, _ = q.shape
    S = k.shape[2]
    fix = "generate with use_cache=False (every step recomputes the full forward, so tokens are right)"
    if spec.capabilities.streaming != "exact":
        raise UnsupportedFeatureError(
            spec.name, f"cached decoding ({where}: {L} new queries after {S - L} cached keys)",
            f"'{spec.name}' is an approximation without an exact streaming form, so attending from the new "
            f"tokens to the cached keys would not equal the full forward; {fix}", _cached_ok(spec.name))
    st = module.__dict__.get("_attnkit_stream")
    why = None
    if isinstance(st, str):
        why = f"its streaming state could not start from the prompt ({st})"
    elif st is None or st.key != entry.key:
        why = "no streaming state from a prefill of this layer (was the prefill run with use_cache=True under no_grad?)"
    elif st.length != S - L or st.state.batch != B:
        why = (f"the layer's state covers {st.length} positions of batch {st.state.batch}, "
               f"the cache {S - L} of batch {B}")
    elif not torch.equal(st.last_key, k[:, :, S - L - 1]):
        why = "the cached keys are not the ones the state was built from (beam search reorders the cache)"
    elif not conv.causal:
        why = f"the mask is {conv.kind}, not causal"
    else:
        kp = conv.key_padding
        past = st.key_padding
        if kp is not None and not bool(kp[:, S - L:].all()):
            why = "some new tokens are padding"
        elif kp is not None and (past is None or not torch.equal(kp[:, :S - L], past)):
            why = "the padding of the cached positions changed since the prefill"
        elif kp is None and past is not None:
            why = "the padding of the cached positions changed since the prefill"
    if why is not None:
        raise UnsupportedFeatureError(spec.name, f"cached decoding ({where})", f"{why}; {fix}", _cached_ok(spec.name))
    out, state = attn.step(q, k[:, :, S - L:], v[:, :, S - L:], st.state)
    padding = None if st.key_padding is None else torch.cat(
        [st.key_padding, st.key_padding.new_ones(B, L)], dim=1)
    module.__dict__["_attnkit_stream"] = _Stream(entry.key, state, S, k[:, :, -1].clone(), padding)
    return out


def _cached_ok(but: str) -> list[str]:
    """Installed mechanisms other than ``but`` that decode with a KV cache: exact ones and exact streaming ones."""
    return [s.name for s in attnkit.available()
            if s.name != but and (s.exact or s.capabilities.streaming == "exact")]


# ============================================================= building modules
def config_options(config: Any, entry: Entry) -> dict[str, Any]:
    """The build options a model config gives ``entry`` (``config.attnkit_options``).

    ``attnkit_options`` is either a flat dict of options for whichever attnkit
    mechanism the model runs (``{"window": 256}``) or a dict of dicts keyed by
    attnkit name or transformers name (``{"local": {"window": 256}}``).

    Raises:
        InvalidInputError: ``attnkit_options`` is not a dict.
    """
    opts = getattr(config, CONFIG_OPTIONS, None)
    if opts is None:
        return {}
    if not isinstance(opts, Mapping):
        raise InvalidInputError(
            f"config.{CONFIG_OPTIONS}: expected a dict of build options (e.g. {{'window': 256}}) or a dict of "
            f"them per mechanism (e.g. {{'local': {{'window': 256}}}}), got {type(opts).__name__} {opts!r}"[:300])
    if opts and all(isinstance(v, Mapping) for v in opts.values()):
        return dict(opts.get(entry.key, opts.get(entry.mechanism, {})))
    return dict(opts)


def _seed(config: Any, entry: Entry, layer_idx: int) -> int:
    base = int(getattr(config, CONFIG_SEED, 0) or 0)
    return (base * 1_000_003 + zlib.crc32(f"{entry.key}:{layer_idx}".encode())) % (2 ** 63)


def _mechanism(entry: Entry, module: nn.Module, H: int, D: int, scaling: float | None,
               query: Tensor) -> attnkit.Attention:
    """The attnkit module of ``entry`` for this transformers module, built on first use and kept on it."""
    holder = module.__dict__["_modules"].get(MODULES_ATTRIBUTE)
    slot = entry.key.replace(".", "_")
    if holder is not None and slot in holder:
        return holder[slot]
    attn = build_for(entry, module, H, D, scaling)
    attn.to(device=query.device, dtype=query.dtype if query.is_floating_point() else None)
    attn.train(module.training)
    if holder is None:
        holder = nn.ModuleDict()
        setattr(module, MODULES_ATTRIBUTE, holder)
    holder[slot] = attn
    return attn


def build_for(entry: Entry, module: nn.Module, H: int, D: int, scaling: float | None) -> attnkit.Attention:
    """Build ``entry``'s mechanism for a transformers attention module with H heads of size D.

    Options: :func:`register`'s, then the config's ``attnkit_options`` over them;
    ``num_heads``/``head_dim``/``scale`` where the mechanism takes them. Built on
    the CPU under a seed from ``config.attnkit_seed``, the name and the layer
    index (the global RNG is left as it was), so random features are the same
    in every run.

    Raises:
        UnsupportedFeatureError: the model needs a non-default scale the mechanism cannot take.
        InvalidInputError: an option the mechanism does not take (the valid ones are listed).
    """
    config = getattr(module, "config", None)
    reg = entry.registry or default_registry()
    spec = reg.resolve(entry.mechanism)
    takes = {o.name for o in spec.resolved_options()}
    options = {**entry.options, **config_options(config, entry)}
    hints: dict[str, Any] = {"num_heads": H, "head_dim": D}
    if scaling is not None and not math.isclose(scaling, D ** -0.5, rel_tol=1e-6):
        if "scale" not in takes:
            raise UnsupportedFeatureError(
                spec.name, f"scaling={scaling} (the model's, head_dim={D})",
                "its options have no scale and the model needs one other than 1/sqrt(head_dim)")
        hints["scale"] = float(scaling)
    layer = int(getattr(module, "layer_idx", 0) or 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(config, entry, layer))
        try:
            return reg.build_with_hints(spec.name, hints, **options)
        except InvalidInputError as exc:
            raise InvalidInputError(
                f"{exc} (building {spec.name!r} for {type(module).__name__} layer {layer}: options come from "
                f"register(...) and the model config's {CONFIG_OPTIONS})") from exc


def prepare(model: nn.Module) -> int:
    """Build the attnkit modules of every attention layer now (before an optimizer or ``load_state_dict``).

    Modules are otherwise built on the first forward; a learned mechanism's
    parameters must exist before ``torch.optim.AdamW(model.parameters())`` sees
    them, and before a saved ``state_dict`` that holds them is loaded.

    Returns:
        the number of attention modules prepared.

    Raises:
        InvalidInputError: the model's ``attn_implementation`` is not registered by this package.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    entry = _ENTRIES.get(impl or "")
    if entry is None:
        raise InvalidInputError(
            f"prepare: the model runs attn_implementation={impl!r}, not a name registered by attnkit_transformers "
            f"(registered: {sorted(_ENTRIES)}); call attnkit_transformers.register() and build the model with "
            "attn_implementation='attnkit:<name>'")
    n = 0
    param = next(model.parameters(), None)
    for m in model.modules():
        if not hasattr(m, "layer_idx") or not hasattr(m, "head_dim") or not hasattr(m, "is_causal"):
            continue
        cfg = getattr(m, "config", None)
        heads = getattr(cfg, "num_attention_heads", None) or getattr(m, "num_heads", None)
        if heads is None:
            continue
        probe = torch.empty(0, dtype=param.dtype if param is not None else torch.float32,
                            device=param.device if param is not None else "cpu")
        _mechanism(entry, m, int(heads), int(m.head_dim), getattr(m, "scaling", None), probe)
        n += 1
    if n == 0:
        warnings.warn("prepare: found no transformers attention module (with layer_idx, head_dim, is_causal)",
                      stacklevel=2)
    return n
