"""The block-sparse engine: one set of kernels executing any mask object's block index.

Public entry point::

    out = attend(q, k, v, mask, scale=scale, backend="auto", block_size=None, positions=None)

- ``q`` ``(B, H, L, D)``, ``k`` ``(B, H, S, D)``, ``v`` ``(B, H, S, E)``.
- ``mask``: an :class:`attnkit.masks.Mask` (the whole mask: pattern, causal,
  key padding, document, composed with ``&`` / ``|``) or None (dense).
- returns ``(B, H, L, E)``; a query row with no allowed key is 0 (finite gradients).

Every backend executes the same :class:`~attnkit_sparse.engine.plan.BlockPlan`
(:func:`plan`): ``torch`` (block gather, any device, autograd), ``numba``
(CPU kernels, forward and backward), ``flex`` (FlexAttention: CUDA forward and
backward, CPU forward only) and ``triton`` (CUDA; CPU tensors under
``TRITON_INTERPRET=1``). :func:`reference_attend` is the dense masked softmax
every pattern's reference calls. See docs/sparse-engine.md.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import operator
import os
from functools import cache
from typing import Any

import torch
from torch import Tensor

from attnkit.caching import reads_traced
from attnkit.errors import BackendUnavailableError, InvalidInputError
from attnkit.masks import Geometry, Mask
from attnkit.positions import Positions, as_positions
from attnkit.transforms import batched, symbolic

from .naive import reference_attend
from .plan import DEFAULT_BLOCK_SIZE, BlockPlan, check_block_size, plan, tl_dot_blocks

#: every backend of the engine, in the order ``auto`` prefers them on CUDA (triton before flex: on an H100 in
#: bfloat16 the triton kernels ran the causal 256-key window faster than the flex backend forward at every
#: length from 1K to 64K, and forward+backward from 16K; docs/benchmarks.md, "GPU")
BACKENDS = ("triton", "flex", "numba", "torch")

#: the ``flex`` backend's block size on CUDA when none is asked for: FlexAttention's own (see flex.kernel_options)
FLEX_CUDA_BLOCK_SIZE = 128


@cache
def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _flex_importable() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
    except ImportError:
        return False
    return True


def why_unavailable(backend: str, device: torch.device | str) -> str | None:
    """None when ``backend`` can run on ``device`` here, else the reason.

    ``flex`` on CPU runs the forward only (PyTorch has no CPU backward of
    FlexAttention): :func:`attend` refuses it when a gradient is needed.
    ``triton`` runs CUDA tensors, and CPU tensors when ``TRITON_INTERPRET=1``
    was set before triton was imported.
    """
    device = torch.device(device)
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; the engine's backends are {BACKENDS}"
    if backend == "torch":
        return None
    if backend == "numba":
        if device.type != "cpu":
            return f"numba kernels run on CPU tensors, the tensors are on {device.type}"
        return None if _importable("numba") else "numba is not installed (pip install numba)"
    if backend == "flex":
        if not _flex_importable():
            return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
        if device.type not in ("cpu", "cuda"):
            return f"FlexAttention runs on CPU or CUDA tensors, the tensors are on {device.type}"
        return None
    if not _importable("triton"):
        return "triton is not installed (pip install triton)"
    if device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    return (f"triton kernels run on CUDA tensors, the tensors are on {device.type} "
            "(set TRITON_INTERPRET=1 before the run to use the interpreter on CPU tensors)")


def available_backends(device: torch.device | str) -> tuple[str, ...]:
    """The engine's backends that can run on ``device`` here, in :data:`BACKENDS` order."""
    return tuple(b for b in BACKENDS if why_unavailable(b, device) is None)


def auto_backend(device: torch.device | str, *, needs_grad: bool = False) -> str:
    """The static choice of ``backend="auto"``: CPU -> numba (else torch); CUDA -> triton, else flex, else torch.

    attnkit's measured choice (``attnkit tune``) is made by the core per
    mechanism before the engine is called (``ctx.backend``); this is the
    fallback when a caller passes ``"auto"`` itself.
    """
    device = torch.device(device)
    order = ("numba", "torch") if device.type == "cpu" else ("triton", "flex", "torch")
    for b in order:
        if why_unavailable(b, device) is None:
            return b
    return "torch"


def flex_cuda_block_size(block_size: Any, needs_grad: bool) -> tuple[Any, str | None]:
    """The ``flex`` backend's block size on CUDA and, when it cannot train there, why.

    None becomes :data:`FLEX_CUDA_BLOCK_SIZE` (FlexAttention's own). FlexAttention's CUDA backward (torch 2.11
    on an H100) keeps only kernel configurations whose tiles divide the blocks, and all of them are 128 wide:
    a gradient through smaller blocks is refused here with a clear reason instead of an inductor error.
    """
    if block_size is None:
        return FLEX_CUDA_BLOCK_SIZE, None
    if needs_grad and any(b % FLEX_CUDA_BLOCK_SIZE for b in check_block_size(block_size)):
        return block_size, (f"FlexAttention's CUDA backward takes blocks that are multiples of "
                            f"{FLEX_CUDA_BLOCK_SIZE} (its kernel configurations), got block_size={block_size!r} "
                            "and a gradient is needed; use block_size=None or 128, or backend 'triton', which "
                            "trains at any power-of-two block >= 16")
    return block_size, None


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, scale: float | None, backend: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise InvalidInputError(f"attend: {name} must be a floating tensor of rank 4 (B, H, *, *), got {got}")
    B, H, _, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H) or k.shape[-1] != D or v.shape[-2] != k.shape[-2]:
        raise InvalidInputError(f"attend: expected q (B, H, L, D), k (B, H, S, D), v (B, H, S, E); got q "
                                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise InvalidInputError(f"attend: q, k, v must share dtype and device, got {q.dtype}/{q.device}, "
                                f"{k.dtype}/{k.device}, {v.dtype}/{v.device}")
    if mask is not None and not isinstance(mask, Mask):
        raise InvalidInputError(f"mask: expected an attnkit.masks.Mask or None, got {type(mask).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise InvalidInputError(f"scale: expected None or a finite float, got {scale!r}")
    if backend != "auto" and backend not in BACKENDS:
        raise InvalidInputError(f"backend: expected 'auto' or one of {BACKENDS}, got {backend!r}")


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, *, scale: float | None = None,
           backend: str = "auto", block_size: int | tuple[int, int] | None = None,
           positions: Positions | None = None) -> Tensor:
    """Block-sparse masked softmax attention ``softmax(scale · q kᵀ, masked) v``.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``; one dtype and device.
        mask: the whole :class:`attnkit.masks.Mask` (bool parts; an additive bias is refused) or None.
        scale: multiplier of ``q · k`` (default ``1/sqrt(D)``).
        backend: ``"auto"`` (:func:`auto_backend`), ``"torch"``, ``"numba"``, ``"flex"`` or ``"triton"``.
        block_size: ``(BQ, BK)`` of the plan, an int for both, or None (64).
        positions: :class:`attnkit.positions.Positions` (or what ``as_positions`` takes) or None.

    Returns:
        ``(B, H, L, E)``. A query with no allowed key gives 0 with finite gradients. Keys and values
        at key-padding positions never reach an output or a gradient, whatever they hold.

    Raises:
        InvalidInputError: malformed inputs, an additive mask, a bad block size or backend name.
        BackendUnavailableError: the backend cannot run here (e.g. ``flex`` on CPU with a gradient).
    """
    _check_inputs(q, k, v, mask, scale, backend)
    B, H, L, D = q.shape
    S = k.shape[-2]
    if positions is not None and not isinstance(positions, Positions):
        positions = as_positions(positions, L=L, S=S)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    name = auto_backend(q.device, needs_grad=needs_grad) if backend == "auto" else backend
    reason = why_unavailable(name, q.device)
    if reason is None and name == "flex" and q.device.type == "cpu":
        from . import flex
        if needs_grad:
            reason = ("PyTorch's FlexAttention has no CPU backward and a gradient is needed; the backends "
                      "that train on CPU are 'numba' and 'torch'")
        elif flex.COMPILE and q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            reason = (f"compiled FlexAttention on CPU takes float32, float16 or bfloat16, got {q.dtype}; "
                      "use 'numba' or 'torch'")
    if reason is None and name == "flex" and q.device.type == "cuda":
        block_size, reason = flex_cuda_block_size(block_size, needs_grad)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run: {reason}")
    kpm = None if mask is None else mask.key_padding_mask
    if kpm is not None:  # padded keys and values never reach an output or a gradient
        keep = kpm.to(q.device)[:, None, :, None]
        k = torch.where(keep, k, torch.zeros((), dtype=k.dtype, device=k.device))
        v = torch.where(keep, v, torch.zeros((), dtype=v.dtype, device=v.device))
    if symbolic(L, S) and positions is None and L == S:
        # torch.export with a dynamic length: a plan would fix the length; a pattern inside a band (plus global
        # keys and queries) attends within it instead, one program for every length (engine/dynamic.py); any
        # other fixes the length below
        from .dynamic import attend_dynamic, cover_of

        cover = cover_of(mask)
        if cover is not None:
            bq, bk = check_block_size(block_size)
            return attend_dynamic(q, k, v, mask, cover, scale, bq if name == "numba" and bq == bk else None)
    if mask is not None and _per_call(mask, positions):   # (torch.export's mask inputs; vmap's per-sample masks)
        return _attend_per_call(q, k, v, mask, scale, block_size, positions)
    p = plan(mask, B, H, L, S, block_size=block_size, device=q.device, positions=positions)
    if name == "torch":
        from . import torch_ops
        return torch_ops.attend(q, k, v, p, scale)
    if name == "numba":
        from . import numba_ops
        return numba_ops.attend(q, k, v, p, scale)
    if name == "flex":
        from . import flex
        return flex.attend(q, k, v, mask, p, scale, positions)
    from . import triton_ops
    return triton_ops.attend(q, k, v, p, scale)


def _per_call(*reads: Any) -> bool:
    """Whether ``reads`` hold values a plan cannot be read from: inputs of a ``torch.export`` trace (fake
    tensors) or tensors batched by ``torch.func.vmap`` (one mask per vmapped sample)."""
    return reads_traced(*reads) or batched(*reads)


def _attend_per_call(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float, block_size: Any,
                     positions: Positions | None) -> Tensor:
    """A call whose mask holds values a plan cannot be read from (:func:`_per_call`): while ``torch.export``
    traces, the mask inputs of the program (a key padding mask, a tensor or document mask); under
    ``torch.func.vmap``, masks batched over the vmapped samples (per-sample gradients with each sample's
    padding). Padded k and v are already zeroed by :func:`attend`. Whatever the backend, the torch backend: the
    plan of the other ``&``-ed parts, built from the shape, and the per-call parts evaluated at every gathered
    pair. Explicit position tensors among those values are not supported: a plan follows the positions."""
    from . import torch_ops

    B, H, L, _ = q.shape
    S = k.shape[-2]
    if positions is not None and _per_call(positions):
        raise InvalidInputError("positions: position tensors among the inputs of torch.export, or batched by "
                                "torch.func.vmap, cannot decide a sparse pattern's block plan; pass positions as "
                                "constants (the same for every vmapped sample)")
    parts = mask.conjuncts()
    is_traced = [_per_call(p) for p in parts]
    traced = [p for p, t in zip(parts, is_traced) if t]
    static = [p for p, t in zip(parts, is_traced) if not t]
    rest = functools.reduce(operator.and_, static) if static else None
    extra = functools.reduce(operator.and_, traced)
    p = plan(rest, B, H, L, S, block_size=block_size, device=q.device, positions=positions)
    geom = Geometry(B, H, L, S, q.device, positions)
    return torch_ops.attend(q, k, v, p, scale, extra=extra, geometry=geom)


#: the backends of :func:`attend_plan` (those that return the log-sum-exp with its gradient)
PLAN_BACKENDS = ("torch", "numba", "triton")


def _auto_plan_backend(device: torch.device, plan: BlockPlan) -> str:
    """``attend_plan``'s ``auto``: numba (else torch) on CPU; on CUDA triton for power-of-two blocks >= 16, else
    torch (FlexAttention returns no differentiable log-sum-exp)."""
    device = torch.device(device)
    if device.type == "cpu":
        return auto_backend(device)
    if tl_dot_blocks(plan.block_size) and why_unavailable("triton", device) is None:
        return "triton"
    return "torch"


def attend_plan(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, *, scale: float | None = None,
                backend: str = "auto", return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Block-sparse masked softmax over the tiles of a given plan (e.g. :func:`explicit_plan`).

    The entry point of content-based mechanisms: they reorder the sequence and
    build the plan of the reordered sequence themselves (docs/sparse-engine.md,
    "Content-based use").

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H, S, D)``; v: ``(B, H, S, E)``; one dtype and device.
        plan: a :class:`BlockPlan` for ``(L, S)`` whose index dims ``(B', H')`` divide ``(B, H)``.
        scale: multiplier of ``q · k`` (default ``1/sqrt(D)``).
        backend: ``"auto"``, ``"torch"``, ``"numba"`` or ``"triton"`` (the backends that return the log-sum-exp
            with its gradient). ``"auto"``: numba (else torch) on CPU; on CUDA triton when the plan's block
            sizes are powers of two >= 16, else torch.
        return_lse: also return the log-sum-exp ``(B, H, L)`` of the allowed scaled scores per row,
            differentiable (``-inf`` for a row with no allowed key).

    Returns:
        ``(B, H, L, E)`` (rows with no allowed key are 0), or ``(out, lse)``.

    Raises:
        InvalidInputError: malformed inputs, a plan for another shape, a backend without this entry point.
        BackendUnavailableError: the backend cannot run here.
    """
    _check_inputs(q, k, v, None, scale, backend)
    B, H, L, D = q.shape
    S = k.shape[-2]
    if not isinstance(plan, BlockPlan) or (plan.L, plan.S) != (L, S):
        got = f"({plan.L}, {plan.S})" if isinstance(plan, BlockPlan) else type(plan).__name__
        raise InvalidInputError(f"plan: expected a BlockPlan for (L, S) = ({L}, {S}), got {got}")
    bp, hp = plan.index_dims
    if B % bp or H % hp:
        raise InvalidInputError(f"plan: index dims (B', H') = ({bp}, {hp}) do not divide (B, H) = ({B}, {H})")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    name = _auto_plan_backend(q.device, plan) if backend == "auto" else backend
    if name not in PLAN_BACKENDS:
        raise InvalidInputError(f"backend: attend_plan runs one of {PLAN_BACKENDS} (the backends that return the "
                                f"log-sum-exp with its gradient), got {name!r}")
    reason = why_unavailable(name, q.device)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} cannot run: {reason}")
    if name == "torch":
        from . import torch_ops
        res = torch_ops.attend(q, k, v, plan, scale, return_lse=return_lse)
    elif name == "numba":
        from . import numba_ops
        res = numba_ops.attend(q, k, v, plan, scale, return_lse=return_lse)
    else:
        from . import triton_ops
        res = triton_ops.attend(q, k, v, plan, scale, return_lse=return_lse)
    if not return_lse:
        return res
    out, lse = res
    return out, torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)


from .explicit import band_plan, explicit_plan  # noqa: E402

__all__ = ["attend", "attend_plan", "explicit_plan", "band_plan", "reference_attend", "plan", "BlockPlan", "BACKENDS",
           "DEFAULT_BLOCK_SIZE", "available_backends", "why_unavailable", "auto_backend", "check_block_size"]
