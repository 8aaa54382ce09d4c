"""Context parallelism: one long sequence split along L across the ranks of a process group.

Rank ``r`` of a group of ``W`` holds the ``r``-th contiguous chunk of every
sequence (queries, keys, values and key padding of positions
``offset_r ... offset_r + L_r - 1``) and gets back the outputs of those
positions, equal to the rows of the single-process causal forward over the
whole sequence, with gradients that flow back to every rank's inputs::

    import torch.distributed as dist
    from attnkit.context_parallel import context_parallel, shard_sequence

    attn = attnkit.build("linear")
    q_r, k_r, v_r = (shard_sequence(t, dim=2) for t in (q, k, v))      # (B, H, L_r, D)
    out_r = context_parallel(attn, q_r, k_r, v_r, causal=True)          # (B, H, L_r, E)

Only implementations whose spec sets ``Capabilities.context_parallel`` run
split; the others refuse with :class:`~attnkit.errors.UnsupportedFeatureError`
naming those that do. An implementation provides
``_context_parallel(q, k, v, cp)`` and exchanges what it needs through the
:class:`ContextParallel` handed to it: :meth:`ContextParallel.gather` (one
differentiable all-gather of a list of tensors per call) and
:meth:`ContextParallel.exclusive_prefix` (fold the earlier ranks' summaries:
the kernelized family's running state), or :meth:`ContextParallel.halo` (the
``width`` positions just before this chunk: a sliding window's keys).

Every collective runs on every rank in the same order, forward and backward:
an implementation must call :meth:`~ContextParallel.gather` the same number of
times on every rank, and the result of each gather is tied into the output
(:meth:`~ContextParallel.tie`) so that each rank's backward runs the matching
all-reduce even where it did not use what it gathered (rank 0 has no prefix).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .amp import autocast_inputs
from .errors import InvalidInputError, UnsupportedFeatureError

__all__ = ["ContextParallel", "context_parallel", "shard_sequence", "chunk_bounds", "sequence_parallel",
           "active_group"]

#: the process groups of the enclosing :func:`sequence_parallel` blocks, innermost last. A plain list,
#: not a ContextVar: torch.compile traces a read of it (and guards on it), it cannot trace ContextVar.get
_ACTIVE: list[Any] = []


@contextlib.contextmanager
def sequence_parallel(group: Any = None) -> Iterator[None]:
    """Inside this block every :class:`attnkit.MultiHeadAttention` runs its attention split along L.

    Each rank feeds the model its chunk of the sequence ``(B, L_r, dim)`` (in rank order);
    the projections, MLPs and norms are per position, so a whole
    :class:`attnkit.Transformer` built from a split-capable attention runs context-parallel::

        with sequence_parallel():
            out_r = model(x_r, causal=True)      # (B, L_r, dim); loss on this rank's positions

    Args:
        group: the process group (None: the default group).
    """
    _ACTIVE.append(group)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active_group() -> list[Any] | None:
    """``[group]`` of the innermost :func:`sequence_parallel` block, else None."""
    return [_ACTIVE[-1]] if _ACTIVE else None


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInputError(
            "context_parallel: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) on every rank first (gloo on CPU, nccl on CUDA)")
    return dist


def chunk_bounds(length: int, world: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of an even split of ``length`` positions over ``world`` ranks (the first
    ``length % world`` ranks get one more)."""
    base, extra = divmod(length, world)
    out, start = [], 0
    for r in range(world):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def shard_sequence(x: Tensor, dim: int = 2, group: Any = None) -> Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (an even split, :func:`chunk_bounds`).

    Args:
        x: the whole sequence on every rank, e.g. ``(B, H, L, D)`` with ``dim=2``
            or a key padding mask ``(B, L)`` with ``dim=1``.
        dim: the sequence dimension.
        group: the process group (None: the default group).

    Raises:
        InvalidInputError: torch.distributed not initialised, or fewer positions than ranks.
    """
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    L = x.shape[dim]
    if L < world:
        raise InvalidInputError(f"shard_sequence: x has {L} positions along dim {dim}, fewer than the {world} "
                                "ranks; every rank needs at least one position")
    start, stop = chunk_bounds(L, world)[rank]
    return x.narrow(dim, start, stop - start)


class _AllGather(torch.autograd.Function):
    """All-gather of one flat buffer (the same length on every rank); backward: the all-reduced
    gradient of this rank's slot, so each rank gets the sum of what every rank's outputs sent back."""

    @staticmethod
    def forward(ctx: Any, flat: Tensor, group: Any, rank: int, world: int) -> Tensor:  # type: ignore[override]
        import torch.distributed as dist

        out = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(out, flat.contiguous(), group=group)
        ctx.group, ctx.rank = group, rank
        return torch.stack(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


class _Tie(torch.autograd.Function):
    """``out`` unchanged; the tied tensors get zero gradients (and so their backward collectives run)."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, *tied: Tensor) -> Tensor:  # type: ignore[override]
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


class ContextParallel:
    """What a rank knows about the split, and the collectives an implementation exchanges through.

    Attributes:
        group: the process group (None: the default group).
        rank, world: this rank's index in the group and the group's size.
        lengths: every rank's chunk length ``L_r``, in rank order.
        offset: the absolute position of this chunk's first query (sum of earlier lengths).
        length: the total sequence length.
        key_padding_mask: this chunk's ``(B, L_r)`` bool mask (True = a real token) or None.
    """

    def __init__(self, group: Any, rank: int, world: int, lengths: Sequence[int],
                 key_padding_mask: Tensor | None) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.lengths = list(lengths)
        self.offset = sum(self.lengths[:rank])
        self.length = sum(self.lengths)
        self.key_padding_mask = key_padding_mask
        self._gathered: list[Tensor] = []

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        """Absolute positions of this chunk's queries, ``(L_r,)``."""
        return torch.arange(self.offset, self.offset + self.lengths[self.rank], device=device)

    def gather(self, tensors: Sequence[Tensor]) -> list[list[Tensor]]:
        """Every rank's ``tensors``, differentiably: ``out[r][i]`` is rank ``r``'s ``tensors[i]``.

        The tensors may differ in shape between ranks (they travel as one padded flat buffer per
        call); they are cast to the first one's dtype and cast back. Gradients reaching ``out[r][i]``
        on any rank flow back to rank ``r``'s input. Call it the same number of times on every rank.
        """
        dist = _dist()
        if not tensors:
            raise InvalidInputError("ContextParallel.gather: expected at least one tensor")
        dtype, device = tensors[0].dtype, tensors[0].device
        shapes = [tuple(t.shape) for t in tensors]
        meta = torch.tensor([len(shapes)] + [len(s) for s in shapes] + [d for s in shapes for d in s],
                            dtype=torch.long)
        size = torch.tensor([meta.numel()], dtype=torch.long)
        sizes = [torch.zeros_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.group)
        width = int(max(int(s) for s in sizes))
        metas = [torch.zeros(width, dtype=torch.long) for _ in range(self.world)]
        dist.all_gather(metas, torch.nn.functional.pad(meta, (0, width - meta.numel())), group=self.group)
        all_shapes = [_unpack_shapes(m) for m in metas]
        numels = [sum(_numel(s) for s in sh) for sh in all_shapes]
        flat = torch.cat([t.to(dtype).reshape(-1) for t in tensors])
        flat = torch.nn.functional.pad(flat, (0, max(numels) - flat.numel()))
        stacked = _AllGather.apply(flat.to(device), self.group, self.rank, self.world)
        self._gathered.append(stacked)
        out: list[list[Tensor]] = []
        for r, sh in enumerate(all_shapes):
            parts, at = [], 0
            for i, s in enumerate(sh):
                n = _numel(s)
                part = stacked[r, at:at + n].reshape(s)
                if i < len(tensors) and tensors[i].dtype != dtype:
                    part = part.to(tensors[i].dtype)
                parts.append(part)
                at += n
            out.append(parts)
        return out

    def exclusive_prefix(self, summaries: Sequence[Sequence[Tensor]],
                         combine: Callable[[Sequence[Tensor], Sequence[Tensor]], Sequence[Tensor]]
                         ) -> Sequence[Tensor] | None:
        """``combine`` folded over the ranks before this one (``summaries[0] . ... . summaries[rank-1]``,
        earlier on the left); None on rank 0. ``combine(a, b)``: the summary of ``a``'s positions then ``b``'s."""
        prefix: Sequence[Tensor] | None = None
        for s in summaries[:self.rank]:
            prefix = s if prefix is None else combine(prefix, s)
        return prefix

    def halo(self, tensors: Sequence[Tensor], width: int, dim: int = 2) -> list[Tensor]:
        """The ``width`` positions just before this chunk (fewer near the start), from earlier ranks.

        Args:
            tensors: this rank's chunk of each tensor, sequence along ``dim`` (keys, values, a
                float key padding mask, ...), all with the same length along ``dim``.
            width: positions wanted (a window's ``window - 1`` past keys).
            dim: the sequence dimension of every tensor.

        Returns:
            the halo of each tensor, ``min(width, offset)`` positions along ``dim``, in order.
        """
        if width < 0:
            raise InvalidInputError(f"ContextParallel.halo: width must be >= 0, got {width}")
        if width == 0:  # nothing to exchange (the same on every rank: no collective)
            return [t.narrow(dim, 0, 0) for t in tensors]
        tails = [t.narrow(dim, t.shape[dim] - min(width, t.shape[dim]), min(width, t.shape[dim]))
                 for t in tensors]
        gathered = self.gather(tails)
        out = []
        for i in range(len(tensors)):
            before = [g[i] for g in gathered[:self.rank]]
            if not before:
                out.append(tails[i].narrow(dim, 0, 0))
                continue
            cat = torch.cat(before, dim=dim)
            n = min(width, cat.shape[dim])
            out.append(cat.narrow(dim, cat.shape[dim] - n, n))
        return out

    def tie(self, out: Tensor) -> Tensor:
        """``out``, tied to every buffer gathered so far (see the module docstring)."""
        gathered, self._gathered = self._gathered, []
        if not gathered or not torch.is_grad_enabled():
            return out
        return _Tie.apply(out, *gathered)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _unpack_shapes(meta: Tensor) -> list[tuple[int, ...]]:
    vals = [int(x) for x in meta.tolist()]
    count = vals[0]
    ranks = vals[1:1 + count]
    dims, at, out = vals[1 + count:], 0, []
    for nd in ranks:
        out.append(tuple(dims[at:at + nd]))
        at += nd
    return out


def _supporters() -> list[str]:
    from .attention import registry_or_none

    reg = registry_or_none()
    try:
        return [s.name for s in reg.available(context_parallel=True)] if reg is not None else []
    except Exception:  # noqa: BLE001 - a registry problem must not hide the refusal
        return []


def context_parallel(attn: Any, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                     key_padding_mask: Tensor | None = None, group: Any = None) -> Tensor:
    """Causal attention of one sequence split along L across the ranks of ``group``.

    Call it on every rank of the group with that rank's chunk; chunks are
    contiguous and in rank order (rank 0 holds the first positions). The
    output rows equal those of ``attn(q, k, v, causal=True, key_padding_mask=...)``
    over the whole sequence on one process, and the backward sends every
    gradient back to the rank that holds the input.

    Args:
        attn: a built attention whose spec sets ``Capabilities.context_parallel``.
        q: this rank's queries ``(B, H, L_r, D)``, ``L_r >= 1`` (chunks may differ in length).
        k: this rank's keys ``(B, H, L_r, D)``.
        v: this rank's values ``(B, H, L_r, E)``.
        causal: must be True: the split forms carry a causal prefix (a running state, a window of
            past keys) from earlier ranks to later ones.
        key_padding_mask: this rank's chunk of the bool key padding mask, ``(B, L_r)``, True = a
            real token; padded keys have no influence whatever they hold.
        group: the process group (None: the default group).

    Returns:
        This rank's output rows ``(B, H, L_r, E)``.

    Raises:
        UnsupportedFeatureError: ``attn`` cannot run split (the message names those that can), or
            ``causal=False``.
        InvalidInputError: torch.distributed not initialised; inputs of the wrong type, rank or
            shape; chunks whose batch, heads or head sizes differ between ranks; an empty chunk.
    """
    from .attention import Attention

    if not isinstance(attn, Attention):
        raise InvalidInputError(f"context_parallel: attn must be an attnkit.Attention, got {type(attn).__name__}")
    caps = attn.caps
    if not getattr(caps, "context_parallel", False):
        raise UnsupportedFeatureError(
            attn.impl_name, "context parallelism (a sequence split across ranks along L)",
            "it has no split form: it needs every key at once, or a state that cannot be passed between ranks",
            _supporters())
    if causal is not True:
        raise UnsupportedFeatureError(
            attn.impl_name, f"context parallelism with causal={causal!r}",
            "the split forms pass a causal prefix (a running state, a window of past keys) from earlier "
            "ranks to later ones; pass causal=True")
    cast = autocast_inputs(q, k, v, caps.dtypes)
    if cast is not None:   # as Attention.forward under autocast: inputs cast once, the split form run with it off
        with torch.autocast(q.device.type, enabled=False):
            return context_parallel(attn, *cast, causal=causal, key_padding_mask=key_padding_mask, group=group)
    attn._check_qkv(q, k, v, "context_parallel")
    B, H, L, _ = q.shape
    if k.shape[2] != L:
        raise InvalidInputError(f"context_parallel: q and k must hold the same positions of this rank's chunk, "
                                f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool \
                or tuple(key_padding_mask.shape) != (B, L):
            got = (f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                   if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__)
            raise InvalidInputError(f"context_parallel: key_padding_mask must be a bool tensor (B, L_r) = "
                                    f"{(B, L)} for this rank's chunk, got {got}")
        if key_padding_mask.device != q.device:
            raise InvalidInputError(f"context_parallel: key_padding_mask is on {key_padding_mask.device}, "
                                    f"q on {q.device}; put them on one device")
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = torch.tensor([B, H, L, q.shape[3], v.shape[3]], dtype=torch.long)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    lengths = [int(s[2]) for s in shapes]
    if any(int(s[2]) < 1 for s in shapes):
        raise InvalidInputError(f"context_parallel: every rank's chunk must hold at least one position, got "
                                f"lengths {lengths} (rank order)")
    fixed = {(int(s[0]), int(s[1]), int(s[3]), int(s[4])) for s in shapes}
    if len(fixed) != 1:
        raise InvalidInputError(f"context_parallel: B, H, D and E must be the same on every rank, got "
                                f"{[tuple(int(x) for x in s) for s in shapes]} as (B, H, L_r, D, E) in rank order")
    if key_padding_mask is not None:  # padded keys have no influence, whatever they hold (NaN, Inf)
        pad = ~key_padding_mask[:, None, :, None]
        k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    cp = ContextParallel(group, rank, world, lengths, key_padding_mask)
    out = attn._context_parallel(q, k, v, cp)
    return cp.tie(out)
