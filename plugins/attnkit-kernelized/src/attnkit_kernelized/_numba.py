"""What the numba kernels share: the thread pool, dynamic scheduling, fastmath flags, array views.

Importing this module imports numba and starts its thread pool; only the
``numba_ops`` modules import it, on the first use of the numba backend.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from attnkit.numba_pool import kernel_threads, run_parallel, start_pool

__all__ = ["FASTMATH", "kernel_threads", "dynamic", "arr", "check_float"]


start_pool()

# reassociation lets LLVM vectorise the short reductions; no NaN/inf
# assumptions, so zeros from masked positions and NaN inputs behave exactly
FASTMATH = {"reassoc", "contract", "nsz"}


def dynamic(fn, *args):
    """Run a parallel kernel on :func:`kernel_threads` threads, handing out its B*H sequences one at a time
    (numba's parallel chunk size 1) instead of in equal static blocks, so a thread slowed by a busy core
    takes fewer (:func:`attnkit.numba_pool.run_parallel`)."""
    return run_parallel(fn, *args)


def arr(x: Tensor) -> np.ndarray:
    """A contiguous NumPy view of a CPU tensor (a copy only when it is not contiguous)."""
    return x.detach().contiguous().numpy()


def check_float(*xs: np.ndarray) -> None:
    """ValueError unless every array is float32 or float64, all of one dtype."""
    if any(x.dtype != xs[0].dtype for x in xs) or xs[0].dtype not in (np.float32, np.float64):
        raise ValueError(f"numba kernels: inputs must share dtype float32 or float64; got {[str(x.dtype) for x in xs]}")
