"""Half precision (float16, bfloat16) in the sparse plugin: what is widened to float32, and where.

Every sparse module takes float16 and bfloat16 inputs and returns its output (and, through autograd, the
gradients of its inputs) in the input dtype. The engine's backends differ in what they compute in half:

- ``triton`` and ``flex``: the operands stay in half (tensor cores), softmax statistics are float32;
- ``numba``: the kernels are float32/float64 only, so they run on float32 copies (output cast back);
- ``torch``: the gathered blocks are widened to float32 (scores, softmax and the weighted sum in float32).

Content-based mechanisms (``lsh``, ``routing``, ``sinkhorn``) compute their hashes, clusters and sorting
matrices in float32 for half inputs (argmax/top-k ties, normalisation and Sinkhorn's iterations are not
reliable in half), and keep their own state in float32 (routing's centroids stay a float32 buffer under
``module.to(torch.bfloat16)``). On ``numba`` and ``torch`` they run end to end on float32 copies; on
``triton`` the attention inside the reordered blocks takes the half operands as they are and the rounds or
clusters are combined in float32.
"""

from __future__ import annotations

import torch

__all__ = ["HALF", "is_half", "wide"]

#: the half-precision dtypes the sparse modules take
HALF = (torch.float16, torch.bfloat16)


def is_half(dtype: torch.dtype) -> bool:
    return dtype in HALF


def wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for a half dtype, else ``dtype`` (float32 and float64 are computed as they are)."""
    return torch.float32 if dtype in HALF else dtype
