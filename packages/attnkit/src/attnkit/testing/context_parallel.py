"""Checking context parallelism: spawned gloo ranks against one process, in float64.

:func:`check_context_parallel` spawns ``world`` CPU processes (gloo, a file
rendezvous: no port to race for) that each build the same attention, split one
sequence along L (chunk lengths may differ, padding with NaN and Inf in the
padded keys and values) and call
:func:`attnkit.context_parallel.context_parallel`; every rank also runs the
whole sequence on its own. Per case it returns the largest differences of the
outputs, the input gradients of each rank's chunk, and the parameter gradients
(summed over ranks) against that single-process forward and backward. An
implementation without the capability must refuse with
:class:`~attnkit.errors.UnsupportedFeatureError`; its case reports the message.

    failures = check_context_parallel([("linear", {})], world=2)
    assert not failures, failures

Plugins test their split forms with it; the integration suite runs it over
every registered name.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CaseResult", "check_context_parallel", "run_cases"]

#: float64 tolerance of outputs and gradients against the single process
ATOL = 1e-9


@dataclass
class CaseResult:
    """One case on one world size: ``status`` is ``"ok"``, ``"mismatch"``, ``"refused"`` or ``"error"``."""

    target: str
    options: dict[str, Any]
    status: str
    errors: dict[str, float] = field(default_factory=dict)
    message: str = ""

    def __str__(self) -> str:
        errs = ", ".join(f"{k} {v:.3g}" for k, v in self.errors.items())
        return f"{self.target} {self.options}: {self.status} {errs} {self.message}".strip()


def _build(target: str, options: dict[str, Any]) -> Any:
    if ":" in target:      # "module:Class", an implementation that is not registered
        mod, _, qual = target.partition(":")
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj(**options)
    import attnkit

    return attnkit.build(target, **options)


def _inputs(lengths: Sequence[int], B: int, H: int, D: int, E: int, seed: int, padding: bool) -> tuple:
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    kpm = None
    if padding:
        kpm = torch.rand(B, L, generator=g) > 0.25
        kpm[0, : min(L, 2)] = False        # a padded start: early chunks may hold no real key
        pad = ~kpm[:, None, :, None]
        k = k.masked_fill(pad, float("nan"))
        v = v.masked_fill(pad, float("inf"))
    return q, k, v, dout, kpm


def _max_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return float("inf")
    if a.shape != b.shape:
        return float("inf")
    d = (a - b).abs()
    return float(d.max()) if d.numel() else 0.0


def _case(rank: int, world: int, lengths: Sequence[int], target: str, options: dict[str, Any],
          shape: tuple[int, int, int, int], seed: int, padding: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from ..context_parallel import context_parallel
    from ..errors import UnsupportedFeatureError

    B, H, D, E = shape
    torch.manual_seed(seed)
    attn = _build(target, options).double().eval()
    q, k, v, dout, kpm = _inputs(lengths, B, H, D, E, seed, padding)
    start = sum(lengths[:rank])
    stop = start + lengths[rank]
    parts = [t[:, :, start:stop].clone().requires_grad_() for t in (q, k, v)]
    try:
        out = context_parallel(attn, *parts, causal=True,
                               key_padding_mask=None if kpm is None else kpm[:, start:stop])
    except UnsupportedFeatureError as exc:
        return {"status": "refused", "message": str(exc)}
    (out * dout[:, :, start:stop]).sum().backward()
    cp_grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                for n, p in attn.named_parameters()}
    for g in cp_grads.values():
        dist.all_reduce(g)
    attn.zero_grad(set_to_none=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attn(*leaves, causal=True, key_padding_mask=kpm)
    (ref * dout).sum().backward()
    errors = {"out": _max_err(out.detach(), ref.detach()[:, :, start:stop])}
    for name, p, leaf in zip("qkv", parts, leaves):
        errors[f"d{name}"] = _max_err(p.grad, leaf.grad[:, :, start:stop])
    for n, p in attn.named_parameters():
        ref_g = p.grad if p.grad is not None else torch.zeros_like(p)
        errors[f"d[{n}]"] = _max_err(cp_grads[n], ref_g)
    finite = bool(torch.isfinite(out).all())
    bad = (not finite) or any(not (e <= ATOL) for e in errors.values())
    return {"status": "mismatch" if bad else "ok", "errors": errors,
            "message": "" if finite else "non-finite output"}


def _worker(rank: int, world: int, init_file: str, outdir: str, lengths: list[int],
            cases: list[tuple[str, dict[str, Any]]], shape: tuple[int, int, int, int], seed: int,
            padding: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = []
    try:
        for target, options in cases:
            try:
                res = _case(rank, world, lengths, target, options, shape, seed, padding)
            except Exception as exc:  # noqa: BLE001 - reported to the parent, with the traceback
                res = {"status": "error", "message": f"rank {rank}: {type(exc).__name__}: {exc}\n"
                                                     f"{traceback.format_exc(limit=6)}"}
                # the other ranks may be inside a collective: nothing sensible is left to run
                results.append(res)
                break
            results.append(res)
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        finally:
            dist.destroy_process_group()


def run_cases(cases: Sequence[tuple[str, dict[str, Any]]], *, world: int = 2, lengths: Sequence[int] | None = None,
              shape: tuple[int, int, int, int] = (2, 2, 8, 8), seed: int = 0, padding: bool = True
              ) -> list[CaseResult]:
    """Run ``cases`` (``(name or "module:Class", options)``) on ``world`` spawned ranks; one result per case.

    Args:
        cases: implementations to build, by registered name or import path, with their options.
        world: ranks to spawn (gloo on CPU).
        lengths: each rank's chunk length (default: uneven, ``3, 4, 5, ...``).
        shape: ``(B, H, D, E)``.
        seed: inputs and module construction (``torch.manual_seed`` on every rank).
        padding: a random key padding mask, NaN and Inf in padded keys and values.

    A case whose worker raised is reported as ``"error"`` with the traceback; the cases after it
    on that world are reported as ``"error"`` too (a rank may have been left inside a collective).
    """
    import torch.multiprocessing as mp

    lengths = list(lengths) if lengths is not None else [3 + r for r in range(world)]
    if len(lengths) != world:
        raise ValueError(f"run_cases: lengths must hold one length per rank ({world}), got {lengths}")
    cases = [(t, dict(o)) for t, o in cases]
    with tempfile.TemporaryDirectory(prefix="attnkit-cp-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_worker, args=(world, init_file, tmp, lengths, cases, tuple(shape), seed, padding),
                 nprocs=world, join=True)
        per_rank = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.json")
            with open(path) as fh:
                per_rank.append(json.load(fh))
    out = []
    for i, (target, options) in enumerate(cases):
        ranks = [res[i] if i < len(res) else {"status": "error", "message": "not reached"} for res in per_rank]
        statuses = {r["status"] for r in ranks}
        if "error" in statuses:
            msg = next(r["message"] for r in ranks if r["status"] == "error")
            out.append(CaseResult(target, options, "error", message=msg))
        elif statuses == {"refused"}:
            out.append(CaseResult(target, options, "refused", message=ranks[0]["message"]))
        elif len(statuses) > 1 and "refused" in statuses:
            out.append(CaseResult(target, options, "error", message="refused on some ranks only"))
        else:
            errors: dict[str, float] = {}
            for r in ranks:
                for k, val in r.get("errors", {}).items():
                    errors[k] = max(errors.get(k, 0.0), val)
            status = "mismatch" if "mismatch" in statuses else "ok"
            msg = "; ".join(r["message"] for r in ranks if r.get("message"))
            out.append(CaseResult(target, options, status, errors, msg))
    return out


def check_context_parallel(cases: Sequence[tuple[str, dict[str, Any]]], *, worlds: Sequence[int] = (2,),
                           **kwargs: Any) -> list[str]:
    """Every case on every world size must match one process (``"ok"``); returns the failures as lines."""
    failures = []
    for world in worlds:
        for res in run_cases(cases, world=world, **kwargs):
            if res.status != "ok":
                failures.append(f"world {world}: {res}")
    return failures
