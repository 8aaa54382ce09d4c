"""attnkit: efficient attention mechanisms behind one contract and one registry.

    >>> import attnkit, torch
    >>> attn = attnkit.build("softmax")
    >>> q = k = v = torch.randn(2, 4, 16, 8)      # (B, H, L, D)
    >>> attn(q, k, v, causal=True).shape
    torch.Size([2, 4, 16, 8])
"""

from __future__ import annotations

from typing import Any

from . import masks
from ._version import API_VERSION, __version__
from .attention import Attention, Limits, ShortestLengths, shortest_lengths
from .aux import aux_losses, clear_aux_losses
from .context import CallContext
from .errors import (
    AmbiguousNameError,
    AttnkitError,
    BackendUnavailableError,
    InvalidInputError,
    PluginLoadError,
    UnknownAttentionError,
    UnsupportedFeatureError,
    UsageError,
)
from .hookspecs import hookimpl
from .layers import Block, MultiHeadAttention, Transformer, TransformerBlock
from .masks import BlockIndex, Mask
from .positions import Positions
from .registry import default_registry
from .spec import AttentionSpec, BlockSpec, Capabilities, OptionSpec, Paper
from .state import AttentionState

__all__ = [
    "API_VERSION", "__version__", "Attention", "AttentionSpec", "Capabilities", "OptionSpec", "Paper",
    "MultiHeadAttention", "Transformer", "TransformerBlock", "Block", "hookimpl",
    "masks", "Mask", "BlockIndex", "Positions", "AttentionState", "CallContext", "Limits",
    "ShortestLengths", "shortest_lengths",
    "aux_losses", "clear_aux_losses", "BlockSpec", "build_block", "get_block_spec", "blocks",
    "register_block", "registered_block",
    "build", "get_spec", "available", "register", "unregister", "registered", "plugin", "plugin_records", "reload",
    "AttnkitError", "InvalidInputError", "UnknownAttentionError", "UnsupportedFeatureError",
    "AmbiguousNameError", "PluginLoadError", "BackendUnavailableError", "UsageError",
]


def build(name: str, **options: Any) -> Attention:
    """Construct the attention registered as ``name`` (or ``family/name``, ``dist:name``).

    Example: ``attnkit.build("performer", num_heads=8, head_dim=64, num_features=256)``.

    Raises:
        UnknownAttentionError: no such name; the message suggests close ones.
        AmbiguousNameError: two distributions provide the name.
        InvalidInputError: an option the implementation does not take.
    """
    return default_registry().build(name, **options)


def get_spec(name: str) -> AttentionSpec:
    """The :class:`AttentionSpec` registered as ``name``."""
    return default_registry().resolve(name)


def available(**capability_filters: Any) -> list[AttentionSpec]:
    """Registered specs matching every filter, e.g. ``available(causal=True, streaming="exact")``."""
    return default_registry().available(**capability_filters)


def register(spec_or_class: Any, **spec_fields: Any) -> AttentionSpec:
    """Register an implementation in this process (an :class:`AttentionSpec`, or a class plus ``name=``)."""
    return default_registry().register(spec_or_class, **spec_fields)


def unregister(spec_or_name: AttentionSpec | str) -> None:
    """Remove an in-process registration."""
    default_registry().unregister(spec_or_name)


def registered(spec_or_class: Any, **spec_fields: Any):
    """Context manager: register for a ``with`` block, always unregister after."""
    return default_registry().registered(spec_or_class, **spec_fields)


def plugin(obj: Any, *, name: str = "local-plugin", **kwargs: Any):
    """Context manager: load a plugin object (hook implementations) for a ``with`` block."""
    return default_registry().plugin(obj, name=name, **kwargs)


def plugin_records() -> list:
    """Records of every discovered plugin: name, distribution, version, status, error."""
    return default_registry().plugin_records()


def reload() -> None:
    """Forget loaded plugins so the next use discovers them again."""
    default_registry().reload()


def build_block(name: str, *, dim: int, num_heads: int, attention: Any = "softmax", **options: Any) -> Block:
    """Construct the block registered as ``name``: a module ``(B, L, dim) -> (B, L, dim)``.

    Example: ``attnkit.build_block("pre-norm", dim=256, num_heads=4, attention="performer", num_features=64)``.

    Raises:
        UnknownAttentionError: no such block; the message suggests close ones.
        InvalidInputError: an option the block (or its attention) does not take.
    """
    return default_registry().build_block(name, dim=dim, num_heads=num_heads, attention=attention, **options)


def get_block_spec(name: str) -> BlockSpec:
    """The :class:`BlockSpec` registered as ``name``."""
    return default_registry().resolve_block(name)


def blocks() -> list[BlockSpec]:
    """Every registered block spec."""
    return default_registry().blocks()


def register_block(spec: BlockSpec) -> BlockSpec:
    """Register a block in this process (a :class:`BlockSpec`)."""
    return default_registry().register_block(spec)


def registered_block(spec: BlockSpec):
    """Context manager: register a block for a ``with`` block, always unregister after."""
    return default_registry().registered_block(spec)
