"""Which installed implementations run under torch.func.grad, torch.func.vmap and torch.export, on their default
backend (the figures in docs/user-guide.md, "torch.func transforms" and "torch.export").

Per implementation, eval mode, B = 2, H = 2, D = 8: ``grad`` of ``out.square().sum()`` w.r.t. q (float64, L = 16)
against autograd; ``vmap`` over two query sets with k, v fixed (float64) against a loop; ``torch.export.export``
of a module calling it (float32, L = 24) against eager, on a fresh module and after one eager call with the
same shapes; and with a dynamic length (``dynamic_shapes``, L from 1 to the instance's ``max_length`` or 4096,
exported at L = 24, run at those of 1, 40 and 130 its limits accept; "specialised": the implementation fixes
the length, which ``torch.export`` reports as a violated constraint), each causal mode.
A refusal (``attnkit.UnsupportedFeatureError``) is reported as such, any other exception as a failure::

    python packages/attnkit/benchmarks/probe_func_export.py [--only NAME ...] [--out FILE.txt]
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from torch.func import grad, vmap

import attnkit
from attnkit.errors import UnsupportedFeatureError
from attnkit.registry import default_registry


class _Call(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module, causal: bool) -> None:
        super().__init__()
        self.attn, self.causal = attn, causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attn(q, k, v, causal=self.causal)


def _outcome(fn) -> str:
    try:
        d = fn()
    except UnsupportedFeatureError:
        return "refused"
    except Exception as exc:  # noqa: BLE001 - the figure counts them
        return f"FAIL ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return "ok" if d < 1e-5 else f"MISMATCH {d:.1e}"


def probe(name: str) -> dict[str, str]:
    spec = attnkit.get_spec(name)
    causal = bool(spec.capabilities.causal)
    hints = {"num_heads": 2, "head_dim": 8, "max_length": 64}

    def build(dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(0)
        return default_registry().build_with_hints(name, hints).eval().to(dtype)

    def rand(L: int, dtype: torch.dtype, seed: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
        return torch.randn(*lead, 2, 2, L, 8, dtype=dtype, generator=torch.Generator().manual_seed(seed))

    a = build(torch.float64)
    q, k, v = (rand(16, torch.float64, s) for s in range(3))

    def g() -> float:
        got = grad(lambda x: a(x, k, v, causal=causal).square().sum())(q)
        x = q.clone().requires_grad_(True)
        a(x, k, v, causal=causal).square().sum().backward()
        return (got - x.grad).abs().max().item()

    def vm() -> float:
        qs = rand(16, torch.float64, 7, (2,))
        got = vmap(lambda x: a(x, k, v, causal=causal))(qs)
        return (got - torch.stack([a(x, k, v, causal=causal) for x in qs])).abs().max().item()

    def ex(warm: bool) -> float:
        m = _Call(build(torch.float32), causal)
        xs = tuple(rand(24, torch.float32, s) for s in range(3))
        with torch.no_grad():
            want = m(*xs) if warm else None   # an eager call first builds the cached plans outside the trace
            got = torch.export.export(m, xs).module()(*xs)
            return (got - (m(*xs) if want is None else want)).abs().max().item()

    def dyn(c: bool) -> float:
        m = _Call(build(torch.float32), c)
        limits = m.attn.limits
        L = torch.export.Dim("L", min=1, max=limits.max_length or 4096)
        with torch.no_grad():
            program = torch.export.export(m, tuple(rand(24, torch.float32, s) for s in range(3)),
                                          dynamic_shapes=({2: L}, {2: L}, {2: L})).module()
            worst = 0.0
            for n in (n for n in (1, 40, 130) if limits.why_not(n, n) is None):
                xs = tuple(rand(n, torch.float32, s) for s in range(3))
                worst = max(worst, (program(*xs) - m(*xs)).abs().max().item())
            return worst

    def dynamic(c: bool) -> str:
        got = _outcome(lambda: dyn(c))
        return "specialised" if "Constraints violated" in got else got

    modes = [c for c, ok in ((False, spec.capabilities.noncausal), (True, spec.capabilities.causal)) if ok]
    return {"grad": _outcome(g), "vmap": _outcome(vm), "export": _outcome(lambda: ex(False)),
            "export after an eager call": _outcome(lambda: ex(True)),
            **{f"dynamic L (causal={c})": dynamic(c) for c in modes}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="implementation names (default: every installed one)")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    names = args.only or sorted(s.name for s in attnkit.available())
    lines: list[str] = []
    totals: dict[str, int] = {}
    for name in names:
        res = probe(name)
        for key, val in res.items():
            totals[key] = totals.get(key, 0) + (val == "ok")
        lines.append(f"{name:20s} " + " | ".join(f"{k}: {v}" for k, v in res.items()))
        print(lines[-1], flush=True)
    lines.append(f"ok of {len(names)}: " + ", ".join(f"{k} {n}" for k, n in totals.items()))
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"torch {torch.__version__}, python {sys.version.split()[0]}\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
