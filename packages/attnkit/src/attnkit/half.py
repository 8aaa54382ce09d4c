"""Half precision for implementations whose code runs in float32: :class:`Float32Inside`.

Mechanisms with pseudo-inverses, iterative normalisations, soft span ramps, top-k
selections or pooled softmaxes lose their meaning in float16/bfloat16. Such an
implementation puts :class:`Float32Inside` before :class:`attnkit.Attention` in its
bases and declares ``"float16"`` and ``"bfloat16"`` in ``Capabilities.dtypes``: q, k
and v are upcast to float32 at the module boundary (after the core has zeroed padded
keys and values), its float32 code runs unchanged and the output is cast back to the
input dtype, so autograd returns the input gradients in the input dtype. Parameters
are cast to the computing dtype where the implementation uses them: a float32 module
called with half inputs keeps float32 parameters and gradients (as under autocast); a
module cast with ``.to(torch.bfloat16)`` holds bfloat16 parameters, upcast per call.
A streaming implementation writes ``_step_body`` (the contract's ``_step``); its state
is computed in float32 and stays float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["HALF_DTYPES", "Float32Inside"]

#: input dtypes :class:`Float32Inside` computes in float32
HALF_DTYPES = (torch.float16, torch.bfloat16)


class Float32Inside:
    """Mixin (before :class:`attnkit.Attention` in the bases): float16/bfloat16 inputs run the float32 code."""

    def _run(self, q: Tensor, k: Tensor, v: Tensor, ctx: Any) -> Any:
        if q.dtype not in HALF_DTYPES:
            return super()._run(q, k, v, ctx)  # type: ignore[misc]
        res = super()._run(q.float(), k.float(), v.float(), ctx)  # type: ignore[misc]
        if isinstance(res, tuple):
            return (res[0].to(q.dtype), *res[1:])
        return res.to(q.dtype)

    def _step(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        if q.dtype not in HALF_DTYPES:
            return self._step_body(q, k, v, state)
        out, state = self._step_body(q.float(), k.float(), v.float(), state)
        return out.to(q.dtype), state

    def _step_body(self, q: Tensor, k: Tensor, v: Tensor, state: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__} declares streaming but has no _step_body")
