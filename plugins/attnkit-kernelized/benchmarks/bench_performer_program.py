"""What causal performer's ``torch.export`` programs cost to make and to run (docs/benchmarks.md, "Session 55").

float32, eval, no gradient, B = 1, H = 8, D = 64, 256 features, causal: the export time of the static program
(exported at ``--length``) and of the dynamic one (exported at a quarter of it, ``torch.export.Dim`` up to 8,192),
on the ``torch`` backend (the log-space form alone) and on ``numba`` (the linear kernels or the log-space form,
one ``torch.cond``); then each program (saved and loaded) and the eager module on ``auto``, alternated in each
round on the same inputs, queries and keys times ``--scale`` (1: bounded exponents on numba and no chunk marked
for pairwise blocks; 3: exponents past the bounds and some chunks marked). Medians over the rounds after the
first. To compare two revisions, run it from a checkout of each (their sources on ``PYTHONPATH``), alternating::

    python plugins/attnkit-kernelized/benchmarks/bench_performer_program.py [--length 4096] [--scale 1] \\
        [--rounds 7] [--threads 2]

Nothing here is a test: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
import warnings

import torch

import attnkit


class _Causal(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q, k, v, causal=True)


def _build(backend: str) -> _Causal:
    torch.manual_seed(0)
    return _Causal(attnkit.build("performer", num_heads=8, head_dim=64, backend=backend).eval())


def _export(backend: str, length: int, dynamic: bool) -> tuple[torch.nn.Module, float]:
    module = _build(backend)
    n = length // 4 if dynamic else length
    args = tuple(torch.randn(1, 8, n, 64) for _ in range(3))
    shapes = ({2: torch.export.Dim("L", min=1, max=8192)},) * 3 if dynamic else None
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(module, args, dynamic_shapes=shapes)
    took = time.perf_counter() - start
    buf = io.BytesIO()
    torch.export.save(exported, buf)
    buf.seek(0)
    return torch.export.load(buf).module(), took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} threads, L = {a.length}, scale {a.scale}", flush=True)
    runs: dict[str, torch.nn.Module] = {}
    for backend in ("torch", "numba"):
        for dynamic in (False, True):
            name = f"{backend} {'dynamic' if dynamic else 'static'} program"
            runs[name], took = _export(backend, a.length, dynamic)
            print(f"export, {name}: {took:.1f} s", flush=True)
    runs["eager auto"] = _build("auto")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, a.length, 64, generator=g) for _ in range(3))
    q, k = q * a.scale, k * a.scale
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for r in range(a.rounds):
            order = list(runs.items()) if r % 2 == 0 else list(runs.items())[::-1]
            for name, fn in order:
                start = time.perf_counter()
                fn(q, k, v)
                times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        print(f"run, {name}: {1e3 * statistics.median(ts[1:]):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
