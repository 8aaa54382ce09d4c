"""Half precision (float16, bfloat16) in the adaptive plugin: every attention computes in float32 inside.

The soft span masks (a ramp of width R over distances), alpha-entmax's bisection
for its threshold and the edge predictor's top-k all lose their meaning in half:
a span ramp of 32 positions over distances of thousands rounds away in
bfloat16, and entmax's threshold search needs more digits than float16 has. So
the modules take float16/bfloat16 inputs, upcast q, k and v to float32 at the
module boundary (after the core has zeroed padded keys and values), run their
float32 code unchanged (numba kernels included) and cast the output back;
autograd returns the input gradients in the input dtype. Parameters are cast to
the computing dtype where they are used: a float32 module called with half
inputs keeps float32 parameters and gradients (as under autocast); a module cast
with ``.to(torch.bfloat16)`` holds bfloat16 parameters, whose gradients come
back in bfloat16. Auxiliary losses are float32 for half inputs.
"""

from __future__ import annotations

from attnkit.half import HALF_DTYPES, Float32Inside

__all__ = ["DTYPES", "HALF_DTYPES", "Float32Inside"]

#: the dtypes every adaptive attention declares
DTYPES = ("float16", "bfloat16", "float32", "float64")
