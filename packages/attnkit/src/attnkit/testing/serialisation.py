"""Serialisation checks: the ``state_dict`` round trip; deepcopy, pickle and ``torch.save`` of the whole module;
the meta-device build (``to_empty`` + ``reset_parameters``)."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch

from .config import ConformanceConfig
from .context import Ctx, meta_initialised, shape_hints


def _outputs(c: Ctx, attn: Any, dt: torch.dtype, who: str) -> list[torch.Tensor]:
    outs = []
    for n, case in enumerate(c.cases(attn, ["plain", "padding"])):
        q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
        outs.append(c.call(attn, f"{who}: {case.describe(dt)}", q, k, v, **case.kwargs(dt)))
    return outs


def check_state_dict(cfg: ConformanceConfig) -> None:
    """``state_dict`` round-trips: load it (via ``torch.save``/``torch.load(weights_only=True)``)
    into an instance built under another seed with the same options; outputs are equal.

    Random features must live in buffers for this to hold. Exact equality on CPU.
    """
    c = Ctx("state_dict", cfg)
    dt = c.precise()
    a = c.build(dtype=dt, seed=cfg.seed)
    b = c.build(dtype=dt, seed=cfg.seed + 1)
    buf = io.BytesIO()
    try:
        torch.save(a.state_dict(), buf)
        buf.seek(0)
        b.load_state_dict(torch.load(buf, weights_only=True))
    except Exception as exc:  # noqa: BLE001
        c.fail(f"saving and loading the state_dict raised {type(exc).__name__}: {exc}")
    cases = c.cases(a, ["plain", "padding"])
    for case, want, got in zip(cases, _outputs(c, a, dt, "original"), _outputs(c, b, dt, "loaded")):
        c.close(got, want, f"{case.describe(dt)}: an instance built with another seed and loaded from the "
                "state_dict disagrees with the original (is some state, e.g. random features, not a buffer?)",
                dtype=dt, against="original", **c.exact())


def _saved(attn: Any) -> Any:
    buf = io.BytesIO()
    torch.save(attn, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def check_serialisation(cfg: ConformanceConfig) -> None:
    """The whole module survives ``copy.deepcopy``, a ``pickle`` round trip and
    ``torch.save``/``torch.load(weights_only=False)``; outputs then equal the original's (exactly, on CPU).

    A module must hold only picklable state (no lambdas, open handles,
    ``MappingProxyType``); its spec travels with it.
    """
    c = Ctx("serialisation", cfg)
    dt = c.precise()
    attn = c.build(dtype=dt)
    want = _outputs(c, attn, dt, "original")
    cases = c.cases(attn, ["plain", "padding"])
    ways: list[tuple[str, Callable[[Any], Any]]] = [
        ("copy.deepcopy", copy.deepcopy),
        ("pickle.loads(pickle.dumps(module))", lambda m: pickle.loads(pickle.dumps(m))),
        ("torch.load(torch.save(module), weights_only=False)", _saved),
    ]
    for how, fn in ways:
        try:
            other = fn(attn)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"{how} raised {type(exc).__name__}: {exc}")
        if type(other) is not type(attn):
            c.fail(f"{how} gave a {type(other).__name__}, expected a {type(attn).__name__}")
        for case, w, g in zip(cases, want, _outputs(c, other, dt, how)):
            c.close(g, w, f"{case.describe(dt)}: the module after {how} disagrees with the original",
                    dtype=dt, against="original", **c.exact())


def check_meta_init(cfg: ConformanceConfig) -> None:
    """The meta-device recipe: built under ``torch.device("meta")``, moved with ``to_empty`` and initialised with
    ``reset_parameters()`` under a seed, the module's ``state_dict`` and outputs equal a build under that seed.

    Large models are built this way (no memory until placed; FSDP's default ``param_init_fn`` calls
    ``reset_parameters()``): a build that reads values (``.item()``, NumPy) fails on ``meta``, and a module whose
    parameters or buffers ``reset_parameters()`` does not set computes with uninitialised memory.
    :meth:`attnkit.Attention.reset_parameters` rebuilds from the module's options; an override must give what a
    build gives. Exact equality on CPU; the plain and padding cases.
    """
    c = Ctx("meta_init", cfg)
    dt = c.precise()
    want = c.build(dtype=dt, seed=cfg.seed + 3)
    meta = meta_initialised(
        lambda: cfg.registry.build_with_hints(cfg.name, shape_hints(c.spec, c.H, c.D, c.E), **cfg.options),
        c.device, cfg.seed + 3, c.fail).to(dtype=dt)
    mine = meta.state_dict()
    for name, t in want.state_dict().items():
        if name not in mine:
            c.fail(f"after the meta-device recipe the state_dict lacks {name!r}")
        c.close(mine[name], t, f"state_dict entry {name!r} after to_empty + reset_parameters() (seeded)",
                dtype=dt if t.is_floating_point() else torch.float64, against="a seeded build's", **c.exact())
    cases = c.cases(want, ["plain", "padding"])
    for case, w, got in zip(cases, _outputs(c, want, dt, "built"), _outputs(c, meta.eval(), dt, "meta-initialised")):
        c.close(got, w, f"{case.describe(dt)}: built under torch.device('meta'), to_empty + reset_parameters()",
                dtype=dt, against="a seeded build's output", **c.exact())
