"""``rfa``: random feature attention with a learned gate (Peng et al. 2021).

* :mod:`.naive`: the plain O(L·S) reference the spec names (the gated form as an explicit weighting).
* :mod:`.chunk`: the ``torch`` backend of the gated causal form (chunked), any device.
* :mod:`.recurrent`: the step form (one position at a time from a state), used by ``step()``.
* :mod:`.numba_ops`: the ``numba`` backend of the gated causal form (CPU kernels, custom operators).
* :mod:`.triton_ops`: the ``triton`` backend of the gated causal form (CUDA kernels of the chunked
  form, forward and backward, custom operators).
* :mod:`.module`: :class:`RandomFeatureAttention`: options, features, gate, dispatch.

The non-causal form is ungated: linear attention on the features, run by the
backends of :mod:`attnkit_kernelized.linear`.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "RandomFeatureAttention":
        from .module import RandomFeatureAttention

        return RandomFeatureAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
