"""attnkit-kernelized: linear, Performer (FAVOR+), RFA and fast-weight (delta rule) attention.

Registered with attnkit through the ``attnkit.plugins`` entry point, so
``attnkit.build("performer", num_heads=8, head_dim=64)`` works once this
package is installed. Causal forms run numba kernels on CPU tensors and triton
kernels on CUDA tensors (triton optional), with a chunked torch form everywhere.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["FastWeightAttention", "LinearAttention", "PerformerAttention", "RandomFeatureAttention", "__version__"]


def __getattr__(name: str):
    # lazy, so importing the package (and listing specs) stays light
    if name == "LinearAttention":
        from .linear import LinearAttention

        return LinearAttention
    if name == "PerformerAttention":
        from .performer import PerformerAttention

        return PerformerAttention
    if name == "RandomFeatureAttention":
        from .rfa import RandomFeatureAttention

        return RandomFeatureAttention
    if name == "FastWeightAttention":
        from .fast_weight import FastWeightAttention

        return FastWeightAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
