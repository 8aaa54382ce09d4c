"""The lab's model: embeddings + :class:`attnkit.Transformer` + a head.

Every attention is trained inside the same model; only the attention module
inside each block differs. Token and learned absolute position embeddings
(as in Zoology's attention baseline) feed a pre-norm ``attnkit.Transformer``;
the head is a linear layer per position (``tokens`` tasks) or over the
mean-pooled real tokens (``classify`` tasks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit


@dataclass
class ModelConfig:
    """Sizes of the lab model.

    Attributes:
        vocab_size: input vocabulary.
        num_outputs: logits per position (``tokens``) or classes (``classify``).
        max_len: longest input (learned position embeddings).
        dim, depth, heads: Transformer width, blocks and heads (``dim % heads == 0``).
        kind: ``"tokens"`` or ``"classify"``.
        causal: causal self-attention.
        attention: registry name.
        attention_options: build options of the attention.
        mlp_ratio, dropout: Transformer block settings.
        token_shift: add a learned projection of the previous position's
            embedding to each position (a width-2 causal convolution, like the
            short convolutions of H3 and Based). It hands attention the
            "previous token" feature that recall tasks need, which a model
            otherwise learns slowly from absolute positions.
        block: registered block name (``attnkit.build_block``); ``"pre-norm"``
            is the standard stack. Another block (e.g. ``"act"``) is stacked
            ``depth`` times with a final LayerNorm.
        block_options: build options of that block.
    """

    vocab_size: int
    num_outputs: int
    max_len: int
    dim: int = 64
    depth: int = 2
    heads: int = 2
    kind: str = "tokens"
    causal: bool = True
    attention: str = "softmax"
    attention_options: dict[str, Any] = field(default_factory=dict)
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    token_shift: bool = False
    block: str = "pre-norm"
    block_options: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class BlockStack(nn.Module):
    """``depth`` registered blocks (``config.block``) and a final LayerNorm, ``(B, L, dim)`` in and out."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # the block's own options (e.g. act@max_steps=8,mlp_ratio=2) override the run's settings
        options = {"mlp_ratio": config.mlp_ratio, "dropout": config.dropout,
                   "attention_options": dict(config.attention_options), **config.block_options}
        self.blocks = nn.ModuleList(
            attnkit.build_block(config.block, dim=config.dim, num_heads=config.heads, attention=config.attention,
                                **options)
            for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim)

    def forward(self, x: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None,
                state: list[Any] | None = None, return_state: bool = False) -> Tensor | tuple[Tensor, list[Any]]:
        """As :meth:`attnkit.Transformer.forward`: ``state`` holds one entry per block (blocks that keep no
        state refuse it with their own error)."""
        if state is None and not return_state:
            for block in self.blocks:
                x = block(x, causal=causal, key_padding_mask=key_padding_mask)
            return self.norm(x)
        new = []
        for i, block in enumerate(self.blocks):
            x, s = block(x, causal=causal, key_padding_mask=key_padding_mask,
                         state=None if state is None else state[i], return_state=True)
            new.append(s)
        return (self.norm(x), new) if return_state else self.norm(x)


def lab_stats(model: nn.Module) -> dict[str, Any]:
    """What modules report about themselves (``lab_stats()``: learned spans, ACT steps, ...), keyed by module path."""
    out: dict[str, Any] = {}
    for name, m in model.named_modules():
        fn = getattr(m, "lab_stats", None)
        if callable(fn):
            try:
                stats = fn()
            except Exception:  # noqa: BLE001 - a reporting hook never breaks a run
                continue
            for k, v in (stats or {}).items():
                out[f"{name}.{k}" if name else k] = v
    return out


class LabModel(nn.Module):
    """Sequence model for the lab's tasks.

    Args:
        config: see :class:`ModelConfig`.

    Shapes: ``tokens`` (B, L) int64, ``key_padding_mask`` (B, L) bool (True =
    real token) or None; output (B, L, num_outputs) for ``tokens`` tasks,
    (B, num_outputs) for ``classify`` tasks.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.kind not in ("tokens", "classify"):
            raise ValueError(f"ModelConfig.kind: expected 'tokens' or 'classify', got {config.kind!r}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Embedding(config.max_len, config.dim)
        self.drop = nn.Dropout(config.dropout)
        self.shift = nn.Linear(config.dim, config.dim) if config.token_shift else None
        if config.block in ("pre-norm", "transformer") and not config.block_options:
            self.body: nn.Module = attnkit.Transformer(
                config.dim, config.depth, config.heads, attention=config.attention,
                mlp_ratio=config.mlp_ratio, dropout=config.dropout,
                attention_options=dict(config.attention_options),
            )
        else:
            self.body = BlockStack(config)
        self.head = nn.Linear(config.dim, config.num_outputs)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None, *, state: Any = None,
                return_state: bool = False) -> Tensor | tuple[Tensor, Any]:
        """Logits; with ``state``/``return_state`` the blocks carry state (segment-level training, ``tokens``
        tasks): returns ``(logits, new_state)``, positions restart at 0 in every segment."""
        B, L = tokens.shape
        if L > self.config.max_len:
            raise ValueError(f"tokens: length {L} exceeds the model's max_len {self.config.max_len}")
        pos = torch.arange(L, device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)[None]
        if self.shift is not None:
            x = x + self.shift(F.pad(x, (0, 0, 1, 0))[:, :-1])
        x = self.drop(x)
        if state is not None or return_state:
            x, state = self.body(x, causal=self.config.causal, key_padding_mask=key_padding_mask, state=state,
                                 return_state=True)
            return self.head(x), state
        x = self.body(x, causal=self.config.causal, key_padding_mask=key_padding_mask)
        if self.config.kind == "tokens":
            return self.head(x)
        if key_padding_mask is None:
            pooled = x.mean(dim=1)
        else:
            w = key_padding_mask.to(x.dtype)[..., None]
            pooled = (x * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)
        return self.head(pooled)

    def carries_segment_state(self) -> bool:
        """True when every attention declares ``"segment"`` streaming (a memory carried across segments)."""
        mods = self.attention_modules()
        return bool(mods) and all(m.caps.streaming == "segment" for m in mods)

    def attention_modules(self) -> list[attnkit.Attention]:
        """The attention module of every block, in order."""
        return [m for m in self.modules() if isinstance(m, attnkit.Attention)]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
