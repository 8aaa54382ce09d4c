"""``linear``: linear attention with a deterministic feature map (Katharopoulos et al. 2020).

* :mod:`.naive`: the plain O(L·S) reference the spec names.
* :mod:`.chunk`: the ``torch`` backend (two matmuls; the chunked causal form), any device.
* :mod:`.recurrent`: the step form (one position at a time from a state), used by ``step()``.
* :mod:`.numba_ops`: the ``numba`` backend (CPU kernels, custom operators).
* :mod:`.triton_ops`: the ``triton`` backend (CUDA kernels, custom operators).
* :mod:`.module`: :class:`LinearAttention`, options and dispatch.

``performer`` and ungated ``rfa`` are linear attention on their own features
and run these same backends.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "LinearAttention":  # lazy: importing a backend module does not import the module class
        from .module import LinearAttention

        return LinearAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
