"""attnkit-kernelized: linear, Performer (FAVOR+), RFA and fast-weight (delta rule) attention.

Registered with attnkit through the ``attnkit.plugins`` entry point, so
``attnkit.build("performer", num_heads=8, head_dim=64)`` works once this
package is installed. One folder per mechanism (``linear/``, ``performer/``,
``rfa/``, ``fast_weight/``) holds its plain reference (``naive.py``), torch
path (``chunk.py``), step form (``recurrent.py``), kernels (``numba_ops.py``,
``triton_ops.py``: ``torch.library`` custom operators) and module
(``module.py``). numba kernels run on CPU tensors, triton kernels on CUDA
tensors (triton optional), the torch path everywhere.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["FastWeightAttention", "LinearAttention", "PerformerAttention", "RandomFeatureAttention", "__version__"]


def __getattr__(name: str):
    # lazy, so importing the package (and listing specs) stays light
    if name == "LinearAttention":
        from .linear.module import LinearAttention

        return LinearAttention
    if name == "PerformerAttention":
        from .performer.module import PerformerAttention

        return PerformerAttention
    if name == "RandomFeatureAttention":
        from .rfa.module import RandomFeatureAttention

        return RandomFeatureAttention
    if name == "FastWeightAttention":
        from .fast_weight.module import FastWeightAttention

        return FastWeightAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
