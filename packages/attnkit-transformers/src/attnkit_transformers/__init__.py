"""attnkit mechanisms inside Hugging Face transformers models, by name.

.. code-block:: python

    import attnkit_transformers
    attnkit_transformers.register()                      # every installed mechanism, as "attnkit:<name>"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnkit:local")

See ``docs/transformers.md``: masks (converted to attnkit mask objects, never
dropped), options (``register(..., **options)`` and ``config.attnkit_options``),
grouped-query attention, and which mechanisms support cached generation
(:func:`generation_support`, :func:`generation_table`).
"""

from __future__ import annotations

from typing import Any

from .integration import (
    CONFIG_OPTIONS,
    CONFIG_SEED,
    MODULES_ATTRIBUTE,
    PREFIX,
    attention_forward,
    config_options,
    prepare,
    register,
    registered,
    unregister,
)
from .masks import Converted, convert

__all__ = [
    "CONFIG_OPTIONS", "CONFIG_SEED", "MODULES_ATTRIBUTE", "PREFIX", "Converted", "attention_forward",
    "config_options", "convert", "generation_support", "generation_table", "prepare", "register", "registered",
    "unregister",
]

__version__ = "0.1.0"


def generation_support(registry: Any = None) -> list[dict[str, str]]:
    """How each registered attnkit mechanism generates with a KV cache (``use_cache=True``).

    Returns:
        one dict per mechanism: ``name``, ``exact``, ``cached`` (``"yes: ..."`` or
        ``"refused: ..."``) and ``masks`` (the transformers masks it honours).
    """
    from attnkit.registry import default_registry

    reg = registry or default_registry()
    rows = []
    for s in reg.specs():
        c = s.capabilities
        if not c.causal:
            cached = "refused: no causal form (decoder models refuse it)"
        elif s.exact:
            cached = ("yes: attends from the new tokens to the cache" if c.causal_cross or c.cross
                      else "refused: no cross-attention form")
        elif c.streaming == "exact":
            cached = "yes: continues its attnkit streaming state"
        else:
            cached = "refused: use generate(use_cache=False)"
        kinds = set(c.mask_kinds)
        masks = "any" if "tensor" in kinds else ", ".join(
            k for k, on in (("causal", "causal" in kinds), ("padding", "key_padding" in kinds)) if on) or "none"
        rows.append({"name": f"attnkit:{s.name}", "exact": "yes" if s.exact else "no", "cached": cached,
                     "masks": masks})
    return rows


def generation_table(registry: Any = None) -> str:
    """:func:`generation_support` as the markdown table of ``docs/transformers.md``."""
    lines = ["| attn_implementation | exact | cached generation (`use_cache=True`) | masks honoured |",
             "| --- | --- | --- | --- |"]
    for r in generation_support(registry):
        lines.append(f"| `{r['name']}` | {r['exact']} | {r['cached']} | {r['masks']} |")
    return "\n".join(lines)
