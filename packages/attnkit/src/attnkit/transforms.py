"""``torch.func`` transforms (``grad``, ``vmap``, ``jvp``) around an attention call, and :func:`plain_torch`.

Under a transform the tensors an implementation sees are wrappers without storage:
NumPy, numba and custom ``torch.autograd.Function`` s written in the old style cannot
run on them. :attr:`attnkit.Capabilities.func_transforms` declares which transforms an
implementation composes with on its ``torch`` backend; :class:`attnkit.Attention` runs
that backend when ``backend="auto"`` and a transform is active, and refuses undeclared
transforms, and other forced backends, with :class:`attnkit.errors.UnsupportedFeatureError`.
"""

from __future__ import annotations

import torch

from .spec import FUNC_TRANSFORMS

__all__ = ["FUNC_TRANSFORMS", "active", "plain_torch"]


def active() -> tuple[str, ...]:
    """The ``torch.func`` transforms wrapping the current call, outermost first (``()`` when none, or while
    ``torch.compile`` traces). ``functionalize`` is left out: it changes no arithmetic an implementation sees."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return ()
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    names = {TransformType.Grad: "grad", TransformType.Vmap: "vmap", TransformType.Jvp: "jvp"}
    found = (names.get(i.key()) for i in retrieve_all_functorch_interpreters())
    return tuple(dict.fromkeys(n for n in found if n is not None))


def plain_torch() -> bool:
    """True when an implementation's fused eager paths must give way to plain torch operators: under a
    ``torch.func`` transform (tensors without storage; custom autograd functions without transform rules) and
    while ``torch.export`` traces (the program is ATen operators: no host reads of tensor values, no ``out=``
    products into kept buffers, no branch on values; it also runs with gradients enabled)."""
    return bool(active()) or torch.compiler.is_exporting()
