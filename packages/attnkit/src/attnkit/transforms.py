"""``torch.func`` transforms (``grad``, ``vmap``, ``jvp``) around an attention call, and :func:`plain_torch`.

Under a transform the tensors an implementation sees are wrappers without storage:
NumPy, numba and custom ``torch.autograd.Function`` s written in the old style cannot
run on them. :attr:`attnkit.Capabilities.func_transforms` declares which transforms an
implementation composes with on its ``torch`` backend; :class:`attnkit.Attention` runs
that backend when ``backend="auto"`` and a transform is active, and refuses undeclared
transforms, and other forced backends, with :class:`attnkit.errors.UnsupportedFeatureError`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .spec import FUNC_TRANSFORMS

__all__ = ["FUNC_TRANSFORMS", "active", "batched", "chunk_count", "dual_inputs", "forward_ad_call", "in_dual_call",
           "plain_torch", "symbolic", "unwrapped"]


def active() -> tuple[str, ...]:
    """The ``torch.func`` transforms wrapping the current call, outermost first (``()`` when none, or while
    ``torch.compile`` traces). ``functionalize`` is left out: it changes no arithmetic an implementation sees.

    A call on dual tensors of ``torch.autograd.forward_ad`` (inside :func:`forward_ad_call`) reports ``"jvp"``
    too: the same forward-mode derivative, so the same rules apply (the torch path, whose operators carry the
    tangents; NumPy, numba and custom functions without a ``jvp`` would drop or refuse them)."""
    if torch.compiler.is_compiling():
        return ()
    dual = ("jvp",) if in_dual_call() else ()
    if torch._C._functorch.peek_interpreter_stack() is None:
        return dual
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    names = {TransformType.Grad: "grad", TransformType.Vmap: "vmap", TransformType.Jvp: "jvp"}
    found = (names.get(i.key()) for i in retrieve_all_functorch_interpreters())
    return tuple(dict.fromkeys((*dual, *(n for n in found if n is not None))))


_dual_calls = threading.local()


def dual_inputs(*reads: object) -> bool:
    """True when a tensor among ``reads`` (searched as :func:`attnkit.caching.tensors_in` does: a state's dict
    too) carries a tangent of forward-mode AD at the current level (``torch.autograd.forward_ad.make_dual`` inside
    ``dual_level``); False at once outside ``dual_level`` and while ``torch.compile`` traces."""
    import torch.autograd.forward_ad as fwAD

    if torch.compiler.is_compiling() or fwAD._current_level < 0:
        return False
    from .caching import tensors_in

    return any(fwAD.unpack_dual(t).tangent is not None for t in tensors_in(*reads))


def in_dual_call() -> bool:
    """True inside :func:`forward_ad_call` that engaged (a call on dual tensors)."""
    return bool(getattr(_dual_calls, "depth", 0))


@contextmanager
def forward_ad_call(dual: bool) -> Iterator[None]:
    """Around an attention call: when ``dual`` (:func:`dual_inputs`), :func:`active` reports ``"jvp"`` for its
    duration, so the call takes what it takes under ``torch.func.jvp`` (the torch path). Nested calls count."""
    if not dual:
        yield
        return
    _dual_calls.depth = getattr(_dual_calls, "depth", 0) + 1
    try:
        yield
    finally:
        _dual_calls.depth -= 1


def batched(*reads: object) -> bool:
    """True when a tensor among ``reads`` (searched as :func:`attnkit.caching.tensors_in` does: masks, positions,
    containers, closures) is batched by an active ``torch.func.vmap``, at any level of wrapping: a per-sample
    key padding mask or tensor mask, one value per vmapped sample. Code that reads such a tensor's values
    (``nonzero``, ``.item()``, a block plan) cannot follow it; elementwise masking can. False at once outside
    transforms."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return False
    from .caching import tensors_in

    f = torch._C._functorch
    for t in tensors_in(*reads):
        while f.is_functorch_wrapped_tensor(t):
            if f.is_batchedtensor(t):
                return True
            t = f.get_unwrapped(t)
    return False


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The tensor beneath every ``torch.func`` wrapper of ``t`` (``t`` itself outside transforms): the values
    every vmapped sample's tensor is a slice of, for checks that read values on the host (a NaN in an input mask)
    where the wrapper cannot be read (vmap refuses data-dependent control flow). Read it, never compute with it:
    what is built from it is outside the transforms."""
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(t):
        t = f.get_unwrapped(t)
    return t


def plain_torch() -> bool:
    """True when an implementation's fused eager paths must give way to plain torch operators: under a
    ``torch.func`` transform (tensors without storage; custom autograd functions without transform rules) and
    while ``torch.export`` traces (the program is ATen operators: no host reads of tensor values, no ``out=``
    products into kept buffers, no branch on values; it also runs with gradients enabled)."""
    return bool(active()) or torch.compiler.is_exporting()


def symbolic(*sizes: object) -> bool:
    """True while ``torch.export`` traces and any of ``sizes`` is symbolic (``torch.SymInt``: a dimension the
    export declares dynamic in ``dynamic_shapes``). Code that would loop or branch on such a size (chunk loops,
    ``if L % C``) takes a form whose operators follow the size instead, so one program serves every length.
    (``torch.compile`` with dynamic shapes keeps the eager forms: it recompiles where they fix a size.)"""
    return torch.compiler.is_exporting() and any(isinstance(n, torch.SymInt) for n in sizes)


def chunk_count(length: torch.SymInt, chunk: int) -> torch.SymInt:
    """``ceil(length / chunk)`` for a length :func:`symbolic` says is dynamic, as a size of its own.

    The count is an unbacked symbol (read with ``.item()`` in the program) with the facts a program needs
    asserted at run time: ``N >= 1`` and ``length <= N·chunk``. Operators on ``(N, chunk)`` blocks of the
    padded length then neither specialise the length nor ask for guards the shape solver cannot prove for
    every length (a backed ``(length + chunk - 1) // chunk`` draws contiguity checks such as ``N == 1`` and
    ``N·chunk != length``, which ``torch.export`` reports as a violated constraint). Loops in Python over the
    count are not possible: write the loop as batched operators (a prefix sum, a masked product).
    """
    if chunk == 1:        # the count is the length itself (an unbacked copy would be asserted >= 2, as the
        return length     # traced length is: a program would then refuse length 1)
    n = torch.scalar_tensor(length, dtype=torch.int64).add(chunk - 1).div(chunk, rounding_mode="floor").item()
    torch._check(n >= 1)
    torch._check(n * chunk >= length)
    # (no upper bound asserted: inside a torch.cond branch its runtime assert becomes torch.sym_sum, which
    # torch.export.save cannot serialise; nothing needs it)
    return n


def assert_at_least(n: int, minimum: int, what: str) -> None:
    """While ``torch.export`` traces ``n`` as a dynamic length (:func:`symbolic`): the program raises when it runs
    with ``n`` below ``minimum`` (the eager forward's :class:`attnkit.attention.ShortestLengths` refuses those).
    The assertion is on an unbacked copy of ``n`` (read back with ``.item()``): asserting on ``n`` itself would
    narrow the dimension's range, which ``torch.export`` reports as a violated constraint of a dimension
    declared from 1. Nothing otherwise."""
    if minimum > 1 and symbolic(n):
        u = torch.scalar_tensor(n, dtype=torch.int64).item()
        torch._check(u >= minimum, lambda: f"{what}: expected at least {minimum} positions")
