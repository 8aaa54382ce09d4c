"""Memory for the blocks a forward keeps for its backward, reused from call to call (CPU).

Fresh memory costs page faults on first touch: the probability blocks that
``softmax_attend`` keeps for its backward are 128 MiB at L = 16K, 256 columns and
8 heads (linformer), and writing them into fresh pages took ~45 ms more than into
reused ones (one thread), every training step. A :class:`KeptBuffer` takes a flat
buffer from a small process-wide pool (or allocates one) and gives it back when it
is freed itself, i.e. when the autograd node holding it goes (after its backward,
once the graph is dropped); the next forward takes it. A graph kept alive keeps
its buffer: a second forward then gets another one, so two graphs never share.
At most :data:`POOL_MAX_BYTES` stay in the pool; :func:`release_kept` frees them.
Other devices allocate as usual (their caching allocators do this already).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

#: the most bytes of free buffers the pool keeps between calls
POOL_MAX_BYTES = 256 << 20

_lock = threading.Lock()
_free: list[Tensor] = []


def _take(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if device.type == "cpu":
        with _lock:
            # the smallest free buffer that fits, if it is not more than twice the size asked for
            fits = [i for i, b in enumerate(_free) if b.dtype == dtype and numel <= b.numel() <= 2 * max(numel, 1)]
            if fits:
                best = _free.pop(min(fits, key=lambda i: _free[i].numel()))
                return best[:numel]
    return torch.empty(numel, dtype=dtype, device=device)


def _give(buf: Tensor) -> None:
    if buf.device.type != "cpu":
        return
    whole = buf._base if buf._base is not None else buf
    nbytes = whole.numel() * whole.element_size()
    if nbytes > POOL_MAX_BYTES:
        return
    with _lock:
        _free.append(whole)
        while sum(b.numel() * b.element_size() for b in _free) > POOL_MAX_BYTES:
            _free.pop(0)                                          # the oldest goes first


def release_kept() -> None:
    """Free the pool's buffers (the next forward with a backward allocates again)."""
    with _lock:
        _free.clear()


class KeptBuffer:
    """A flat buffer of ``numel`` elements for one forward's kept blocks, back to the pool when this is freed.

    Args:
        numel: number of elements.
        dtype, device: of the buffer.
    """

    __slots__ = ("buf", "used")

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buf = _take(numel, dtype, device)
        self.used = 0

    def next(self, shape: tuple[int, ...]) -> Tensor:
        """The next unused ``shape`` block of the buffer (contiguous); ValueError past its end."""
        n = 1
        for s in shape:
            n *= s
        if self.used + n > self.buf.numel():
            raise ValueError(f"shape: {tuple(shape)} needs {n} elements, only {self.buf.numel() - self.used} "
                             f"of {self.buf.numel()} left")
        out = self.buf[self.used:self.used + n].view(shape)
        self.used += n
        return out

    def __del__(self) -> None:
        try:
            _give(self.buf)
        except Exception:          # noqa: BLE001 - interpreter shutdown: the module may be half torn down
            pass
