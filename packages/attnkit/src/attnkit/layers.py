"""Layers around any registered attention: multi-head projections, blocks and a small pre-norm stack.

:class:`Block` is the contract of block-level mechanisms (registered through
the ``attnkit_register_block`` hook and built with :func:`attnkit.build_block`):
``(B, L, dim) -> (B, L, dim)`` with the same masks, positions and state as an
attention. :class:`TransformerBlock` is the standard pre-norm block, registered
as ``"pre-norm"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .attention import Attention, registry_or_none
from .aux import AuxLossMixin, bind_aux_records
from .context_parallel import active_group, context_parallel
from .errors import InvalidInputError
from .reset import build_maker, reset_from_build


def _bind_aux_hook(module: nn.Module, args: Any, output: Any) -> None:
    bind_aux_records(module, output)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"{name}: expected a positive int, got {value!r}")
    return value


def _make_attention(attention: str | Attention, num_heads: int, head_dim: int, options: dict) -> Attention:
    if isinstance(attention, Attention):
        if options:
            raise InvalidInputError(
                f"attention options {sorted(options)} were given with an already built attention module; "
                "pass them to attnkit.build instead"
            )
        return attention
    if not isinstance(attention, str):
        raise InvalidInputError(
            f"attention: expected a registered name or an attnkit.Attention, got {type(attention).__name__}"
        )
    reg = registry_or_none()
    if reg is None:  # pragma: no cover - attnkit/__init__ imports the registry
        raise InvalidInputError("attention: building by name needs attnkit.registry imported (import attnkit)")
    return reg.build_with_hints(
        attention, {"num_heads": num_heads, "head_dim": head_dim}, **options
    )


class MultiHeadAttention(nn.Module):
    """Multi-head attention with q/k/v/out projections around a registered attention.

    Args:
        dim: model width; ``dim = num_heads * head_dim``.
        num_heads: number of heads H.
        attention: a registered name (``"softmax"``, ``"performer"``, ...) or an
            :class:`attnkit.Attention` instance.
        bias: projections with bias.
        dropout: dropout on the output projection in training.
        **attention_options: passed to :func:`attnkit.build`.

    Shapes: ``x`` ``(B, L, dim)``, ``context`` ``(B, S, dim)``, output ``(B, L, dim)``.

    For a shared-QK attention (``Capabilities.shared_qk``, e.g. Reformer's
    ``lsh``) there is no key projection (``k_proj`` is None) and the attention
    gets ``k = q``; a ``context`` is then refused (self-attention only).
    """

    def __init__(self, dim: int, num_heads: int, attention: str | Attention = "softmax", *,
                 bias: bool = True, dropout: float = 0.0, **attention_options: Any) -> None:
        super().__init__()
        _positive_int("dim", dim)
        _positive_int("num_heads", num_heads)
        if dim % num_heads:
            raise InvalidInputError(f"dim: expected a multiple of num_heads={num_heads}, got {dim}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.attention = _make_attention(attention, num_heads, self.head_dim, attention_options)
        self.q_proj = nn.Linear(dim, dim, bias=bias)
        #: shared-QK mechanisms (``Capabilities.shared_qk``) derive keys from queries: no key projection
        self.shared_qk = bool(getattr(self.attention.caps, "shared_qk", False))
        self.k_proj = None if self.shared_qk else nn.Linear(dim, dim, bias=bias)
        self.v_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def _qkv(self, x: Tensor, src: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = self._split(self.q_proj(x))
        k = q if self.k_proj is None else self._split(self.k_proj(src))
        return q, k, self._split(self.v_proj(src))

    def _split(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge(self, x: Tensor) -> Tensor:
        B, H, L, E = x.shape
        return x.transpose(1, 2).reshape(B, L, H * E)

    def _check_x(self, x: Any, name: str) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise InvalidInputError(f"{name}: expected a (B, L, dim={self.dim}) tensor, got {got}")

    def forward(self, x: Tensor, context: Tensor | None = None, *, mask: Any = None, causal: bool = False,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, positions: Any = None,
                state: Any = None, return_state: bool = False) -> Tensor | tuple[Tensor, Any]:
        """Self-attention over ``x``, or cross-attention from ``x`` to ``context``.

        ``key_padding_mask`` is ``(B, S)`` bool, True = real token (S = L for
        self-attention). ``attn_mask`` broadcasts to ``(B, H, L, S)``. ``mask``,
        ``positions``, ``state`` and ``return_state`` go to the attention (see
        :meth:`attnkit.Attention.forward`); with ``return_state`` the result is
        ``(out, new_state)``.
        """
        self._check_x(x, "x")
        src = x if context is None else context
        if context is not None:
            self._check_x(context, "context")
            if self.shared_qk:
                raise InvalidInputError(
                    f"context: {self.attention.impl_name!r} shares queries and keys (shared-QK): it is "
                    "self-attention only, got a context for cross-attention")
        q, k, v = self._qkv(x, src)
        split = active_group()
        if split is not None:   # inside attnkit.context_parallel.sequence_parallel(): x is this rank's chunk
            extra = [n for n, val in (("context", context), ("mask", mask), ("attn_mask", attn_mask),
                                      ("positions", positions), ("state", state)) if val is not None]
            if extra or return_state:
                raise InvalidInputError(
                    f"MultiHeadAttention: inside sequence_parallel() the attention runs split along L and takes "
                    f"causal=True and key_padding_mask only; got {', '.join(extra or ['return_state=True'])}")
            out = context_parallel(self.attention, q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                   group=split[0])
            return self.dropout(self.out_proj(self._merge(out)))
        out = self.attention(q, k, v, mask=mask, causal=causal, key_padding_mask=key_padding_mask,
                             attn_mask=attn_mask, positions=positions, state=state, return_state=return_state)
        if return_state:
            out, state = out
            return self.dropout(self.out_proj(self._merge(out))), state
        return self.dropout(self.out_proj(self._merge(out)))

    def init_state(self, batch: int, *, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> Any:
        """Streaming state of the inner attention."""
        return self.attention.init_state(batch, device=device, dtype=dtype)

    def step(self, x: Tensor, state: Any) -> tuple[Tensor, Any]:
        """Consume ``x`` ``(B, T, dim)`` new positions; returns ``((B, T, dim), new_state)``."""
        self._check_x(x, "x")
        q, k, v = self._qkv(x, x)
        out, state = self.attention.step(q, k, v, state)
        return self.dropout(self.out_proj(self._merge(out))), state


class Block(AuxLossMixin, nn.Module):
    """Base class of block-level mechanisms: ``(B, L, dim) -> (B, L, dim)``.

    A block owns its attention (built by name) and whatever surrounds it
    (norms, MLP, gates, a halting unit). Subclasses implement :meth:`forward`
    with the keyword arguments below, and :meth:`init_state`/:meth:`step` when
    they stream. Auxiliary losses (e.g. a ponder cost) are recorded with
    :meth:`record_aux_loss` and collected by :func:`attnkit.aux_losses`.

    ``forward(x, *, mask=None, causal=False, key_padding_mask=None,
    attn_mask=None, positions=None, state=None, return_state=False)``:
    ``x`` ``(B, L, dim)``; the mask arguments as in
    :meth:`attnkit.Attention.forward`; returns ``(B, L, dim)`` or
    ``(out, new_state)``.
    """

    #: the registered block spec (set by :func:`attnkit.build_block`)
    block_spec: Any = None

    def __init__(self) -> None:
        super().__init__()
        # the auxiliary losses a forward records are tied to its output (attnkit.aux: dropped when a backward
        # through the output runs without them)
        self.register_forward_hook(_bind_aux_hook)

    def reset_parameters(self) -> None:
        """Initialise every parameter and buffer as ``attnkit.build_block`` with this block's options does (see
        :meth:`attnkit.Attention.reset_parameters`; the meta-device recipe).

        Raises:
            InvalidInputError: the block holds parameters or buffers and was not built by ``attnkit.build_block``.
        """
        opts = self.__dict__.get("build_options")
        reset_from_build(self, build_maker(self.block_spec, opts), type(self).__name__)

    def forward(self, x: Tensor, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def init_state(self, batch: int, **kwargs: Any) -> Any:
        raise InvalidInputError(f"{type(self).__name__} does not stream (no init_state)")

    def step(self, x: Tensor, state: Any) -> tuple[Tensor, Any]:
        raise InvalidInputError(f"{type(self).__name__} does not stream (no step)")


class TransformerBlock(Block):
    """Pre-norm block (registered as ``"pre-norm"``): ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Args:
        dim: model width.
        num_heads: heads.
        attention: registered name or :class:`attnkit.Attention`.
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``; 0 gives an
            attention-only block (as in Zoology's MQAR models).
        dropout: dropout after attention and MLP.
        attention_options: options for :func:`attnkit.build`.
        **options: more options for :func:`attnkit.build` (what
            :func:`attnkit.build_block` passes on).
    """

    def __init__(self, dim: int, num_heads: int, attention: str | Attention = "softmax", *,
                 mlp_ratio: float = 4.0, dropout: float = 0.0,
                 attention_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__()
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or mlp_ratio < 0:
            raise InvalidInputError(f"mlp_ratio: expected a number >= 0 (0 = no MLP), got {mlp_ratio!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise InvalidInputError(f"dropout: expected a float in [0, 1), got {dropout!r}")
        both = set(options) & set(attention_options or {})
        if both:
            raise InvalidInputError(f"attention options {sorted(both)} given twice (attention_options and keywords)")
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, num_heads, attention, dropout=dropout,
                                       **{**(attention_options or {}), **options})
        self.norm2: nn.Module | None = None
        self.mlp: nn.Module | None = None
        if mlp_ratio > 0:
            hidden = max(1, int(dim * mlp_ratio))
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim), nn.Dropout(dropout))

    def _ffn(self, x: Tensor) -> Tensor:
        return x if self.mlp is None else x + self.mlp(self.norm2(x))

    def forward(self, x: Tensor, *, mask: Any = None, causal: bool = False,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, positions: Any = None,
                state: Any = None, return_state: bool = False) -> Tensor | tuple[Tensor, Any]:
        """``(B, L, dim)`` in and out; masks, positions and state as in :meth:`attnkit.Attention.forward`."""
        h = self.attn(self.norm1(x), mask=mask, causal=causal, key_padding_mask=key_padding_mask,
                      attn_mask=attn_mask, positions=positions, state=state, return_state=return_state)
        if return_state:
            h, state = h
            return self._ffn(x + h), state
        return self._ffn(x + h)

    def init_state(self, batch: int, **kwargs: Any) -> Any:
        return self.attn.init_state(batch, **kwargs)

    def step(self, x: Tensor, state: Any) -> tuple[Tensor, Any]:
        h, state = self.attn.step(self.norm1(x), state)
        return self._ffn(x + h), state


class Transformer(nn.Module):
    """A stack of pre-norm :class:`TransformerBlock` and a final LayerNorm, ``(B, L, dim)`` in and out.

    Args:
        dim: model width.
        depth: number of blocks.
        num_heads: heads per block.
        attention: registered name used by every block.
        mlp_ratio: MLP hidden width multiple; 0 for attention-only blocks.
        dropout: dropout inside blocks.
        attention_options: options for :func:`attnkit.build`.
    """

    def __init__(self, dim: int, depth: int, num_heads: int, attention: str = "softmax", *,
                 mlp_ratio: float = 4.0, dropout: float = 0.0,
                 attention_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        _positive_int("depth", depth)
        self.blocks = nn.ModuleList(
            TransformerBlock(dim, num_heads, attention, mlp_ratio=mlp_ratio, dropout=dropout,
                             attention_options=attention_options)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: Tensor, *, mask: Any = None, causal: bool = False,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, positions: Any = None,
                state: list[Any] | None = None, return_state: bool = False) -> Tensor | tuple[Tensor, list[Any]]:
        """``(B, L, dim)`` in and out; ``state`` is a list with one entry per block (or None)."""
        kw = {"mask": mask, "causal": causal, "key_padding_mask": key_padding_mask, "attn_mask": attn_mask,
              "positions": positions}
        if state is not None and (not isinstance(state, list) or len(state) != len(self.blocks)):
            raise InvalidInputError(
                f"state: expected a list of {len(self.blocks)} block states (one per block), "
                f"got {type(state).__name__}")
        if not return_state and state is None:
            for block in self.blocks:
                x = block(x, **kw)
            return self.norm(x)
        new = []
        for i, block in enumerate(self.blocks):
            x, s = block(x, **kw, state=None if state is None else state[i], return_state=True)
            new.append(s)
        return (self.norm(x), new) if return_state else self.norm(x)

    def init_state(self, batch: int, **kwargs: Any) -> list[Any]:
        return [b.init_state(batch, **kwargs) for b in self.blocks]

    def step(self, x: Tensor, state: list[Any]) -> tuple[Tensor, list[Any]]:
        new = []
        for block, s in zip(self.blocks, state):
            x, s = block.step(x, s)
            new.append(s)
        return self.norm(x), new
