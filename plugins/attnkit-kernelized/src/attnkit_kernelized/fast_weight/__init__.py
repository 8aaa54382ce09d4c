"""``fast-weight`` (alias ``delta``): the delta-rule fast weight memory (Schlag et al. 2021), causal only.

* :mod:`.naive`: the plain reference the spec names (the delta rule as a per-step loop).
* :mod:`.chunk`: the ``torch`` backend (chunked UT-transform form), any device.
* :mod:`.recurrent`: the step form (one position at a time from a state), used by ``step()``.
* :mod:`.numba_ops`: the ``numba`` backend (CPU kernels, custom operators).
* :mod:`.triton_ops`: the ``triton`` backend (CUDA kernels of the chunked UT-transform form, forward and
  backward, custom operators).
* :mod:`.module`: :class:`FastWeightAttention`: options, features, beta, dispatch.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "FastWeightAttention":
        from .module import FastWeightAttention

        return FastWeightAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
