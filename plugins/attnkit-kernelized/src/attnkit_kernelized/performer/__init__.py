"""``performer``: FAVOR+ random-feature softmax attention (Choromanski et al. 2021).

* :mod:`.naive`: the plain O(L·S) reference the spec names.
* :mod:`.module`: :class:`PerformerAttention`: options, random features, stabilisers, dispatch.

Performer is linear attention on its random features: its ``torch``,
``numba`` and ``triton`` backends and its step form are those of
:mod:`attnkit_kernelized.linear`; the features are in
:mod:`attnkit_kernelized.feature_maps`.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "PerformerAttention":
        from .module import PerformerAttention

        return PerformerAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
