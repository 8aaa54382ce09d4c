"""Streaming checks: ``step`` and ``forward(state=..., return_state=True)`` equal the causal forward;
states from elsewhere are refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..errors import InvalidInputError
from ..state import AttentionState
from .config import DTYPE_NAMES, DTYPES, CheckFailed, ConformanceConfig
from .context import Ctx, grad_names


def _chunks(L: int, chunk: int | None) -> list[tuple[int, int]]:
    size = L if chunk is None else chunk
    return [(s, min(L, s + size)) for s in range(0, L, size)]


def _by_step(c: Ctx, attn: Any, label: str, q: Tensor, k: Tensor, v: Tensor, chunk: int | None,
             dt: torch.dtype) -> Tensor:
    """``init_state`` + ``step`` over the chunks (no grad), outputs concatenated."""
    __tracebackhide__ = True
    outs = []
    try:
        with torch.no_grad():
            state = attn.init_state(c.B, device=c.device, dtype=dt)
            for s, e in _chunks(q.shape[2], chunk):
                o, state = attn.step(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], state)
                if not isinstance(o, Tensor) or tuple(o.shape) != (c.B, c.H, e - s, c.E):
                    got = tuple(o.shape) if isinstance(o, Tensor) else type(o).__name__
                    c.fail(f"{label}: step on positions {s}..{e - 1} returned {got}, expected "
                           f"(B, H, T, E) = {(c.B, c.H, e - s, c.E)}")
                outs.append(o)
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: init_state/step raised {type(exc).__name__}: {exc}")
    return torch.cat(outs, dim=2)


def _by_forward(c: Ctx, attn: Any, label: str, q: Tensor, k: Tensor, v: Tensor, chunk: int | None,
                grad: bool) -> Tensor:
    """``forward(chunk, causal=True, state=s, return_state=True)`` chunk by chunk, under autograd."""
    __tracebackhide__ = True
    outs, state = [], None
    try:
        with torch.set_grad_enabled(grad):
            for s, e in _chunks(q.shape[2], chunk):
                o, state = attn(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal=True, state=state,
                                return_state=True)
                if not isinstance(state, AttentionState):
                    c.fail(f"{label}: forward(..., return_state=True) returned a {type(state).__name__} "
                           "state, expected an attnkit.AttentionState")
                outs.append(o)
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: forward(..., causal=True, state=..., return_state=True) raised "
               f"{type(exc).__name__}: {exc}")
    return torch.cat(outs, dim=2)


def check_streaming(cfg: ConformanceConfig) -> None:
    """``step`` and ``forward(state=..., return_state=True)``, chunk by chunk, equal the causal forward.

    ``streaming="exact"``: chunks of 1, 3 and the whole sequence (configurable),
    every tested dtype; both spellings' concatenated outputs equal
    ``forward(causal=True)`` over the whole sequence, and the
    ``forward(state=...)`` path, run under autograd, gives the same gradients
    of q, k, v and parameters (float32/float64; unless ``state_detached``).
    ``"segment"``: shapes, finiteness, and the configured
    ``streaming_reference`` when given (both spellings).
    """
    c = Ctx("streaming", cfg)
    kind = c.caps.streaming
    if kind is None:
        c.skip("the spec declares no streaming (its refusal is tested by 'refusals')")
    L = c.L
    for dt in c.dtypes():
        attn = c.build(dtype=dt)
        with_grad = dt in c.float_dtypes() and c.trains(cfg.options.get("backend")) and not c.caps.state_detached
        q, k, v = c.inputs(L, L, dt, requires_grad=with_grad)
        dname = DTYPE_NAMES[dt]
        full = full_g = None
        if kind == "exact":
            label = f"causal=True, L={L}, dtype={dname}"
            full = c.call(attn, label, q, k, v, grad=with_grad, causal=True)
            if with_grad:
                full_g = c.grads(attn, full, (q, k, v), label, seed=1600)
        factor = 1.0 if dt in (torch.float32, torch.float64) else 2.0
        atol, rtol = c.tol(dt, factor)
        for chunk in cfg.streaming_chunks:
            size = L if chunk is None else chunk
            label = f"streaming={kind!r}, chunk={size}{' (whole sequence)' if chunk is None else ''}, " \
                    f"L={L}, dtype={dname}"
            stepped = _by_step(c, attn, f"{label}, step", q.detach(), k.detach(), v.detach(), chunk, dt)
            c.finite(stepped, f"{label}, step", "concatenated step outputs")
            fwd = _by_forward(c, attn, f"{label}, forward(state=...)", q, k, v, chunk, with_grad)
            c.finite(fwd, f"{label}, forward(state=...)", "concatenated outputs")
            if full is not None:
                c.close(stepped, full, f"{label}: concatenated step outputs differ from forward(causal=True)",
                        dtype=dt, atol=atol, rtol=rtol, against="parallel causal forward")
                c.close(fwd, full, f"{label}: concatenated forward(state=..., return_state=True) outputs "
                        "differ from forward(causal=True)", dtype=dt, atol=atol, rtol=rtol,
                        against="parallel causal forward")
                if full_g is not None:
                    got_g = c.grads(attn, fwd, (q, k, v), f"{label}, forward(state=...)", seed=1600)
                    for name, a, b in zip(grad_names(attn), got_g, full_g):
                        like = a if a is not None else b
                        if like is None:
                            continue
                        c.close(torch.zeros_like(like) if a is None else a, torch.zeros_like(like) if b is None
                                else b, f"{label}: gradients through forward(state=..., return_state=True) "
                                "differ from those of forward(causal=True)", dtype=dt, what=f"gradient of {name}",
                                atol=atol * 10, rtol=rtol * 10, against="parallel causal forward")
            elif cfg.streaming_reference is not None:
                expected = cfg.streaming_reference(attn, q.detach(), k.detach(), v.detach(), size)
                if expected is not None:
                    c.close(stepped, expected, f"{label}: step outputs differ from the streaming_reference",
                            dtype=dt, against="streaming_reference")
                    c.close(fwd, expected, f"{label}: forward(state=...) outputs differ from the "
                            "streaming_reference", dtype=dt, against="streaming_reference")


def check_state_validation(cfg: ConformanceConfig) -> str:
    """A state from elsewhere gives :class:`~attnkit.errors.InvalidInputError`, never a silent cast or reset.

    Through both ``step`` and ``forward(state=...)``: a state for another
    batch size; in another dtype (when two are declared); on another device
    (when CUDA is available; skipped on CPU-only machines); from another
    mechanism; from the same mechanism with another configuration
    (``scale`` or ``num_heads``); something that is not a state at all.
    """
    c = Ctx("state_validation", cfg)
    if c.caps.streaming is None:
        c.skip("the spec declares no streaming (its refusal is tested by 'refusals')")
    dt = c.precise()
    attn = c.build(dtype=dt)
    q, k, v = c.inputs(3, 3, dt)
    notes = []
    bad: list[tuple[str, Any]] = []

    def state_of(module: Any, batch: int, dtype: torch.dtype, device: Any) -> Any:
        try:
            return module.init_state(batch, device=device, dtype=dtype)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"init_state({batch}, dtype={dtype}, device={device}) raised {type(exc).__name__}: {exc}")

    bad.append((f"a state for batch size {c.B + 1} (q has B={c.B})", state_of(attn, c.B + 1, dt, c.device)))
    others = [DTYPES[d] for d in c.caps.dtypes if DTYPES[d] != dt]
    if others:
        bad.append((f"a state of dtype {DTYPE_NAMES[others[-1]]} (q is {DTYPE_NAMES[dt]})",
                    state_of(attn, c.B, others[-1], c.device)))
    else:
        notes.append("another dtype: only one dtype declared")
    if torch.cuda.is_available() and c.device.type == "cpu":
        bad.append(("a state on cuda (q is on cpu)", state_of(attn, c.B, dt, torch.device("cuda"))))
    else:
        notes.append("another device: no second device here")
    if c.spec.name != "softmax":
        other = c.cfg.registry.build("softmax").to(dtype=dt)
        bad.append(("a state of 'softmax'", state_of(other, c.B, dt, c.device)))
    else:
        real = state_of(attn, c.B, dt, c.device)
        forged = AttentionState(("another-mechanism", real.owner[1]), c.B, dt, c.device, real.data)
        bad.append(("a state owned by 'another-mechanism'", forged))
    if "scale" in c.takes and "scale" not in cfg.options:
        bad.append(("a state of the same mechanism built with scale=0.37",
                    state_of(c.build(dtype=dt, scale=0.37), c.B, dt, c.device)))
    elif "num_heads" in c.takes and "num_heads" not in cfg.options:
        bad.append((f"a state of the same mechanism built with num_heads={c.H + 1}",
                    state_of(c.build(dtype=dt, heads=c.H + 1), c.B, dt, c.device)))
    else:
        notes.append("another configuration: the factory takes neither scale nor num_heads")
    bad.append(("a plain dict instead of a state", {}))
    for what, state in bad:
        c.expect_error(f"step(q (B={c.B}, {DTYPE_NAMES[dt]}), {what})", InvalidInputError,
                       "a state from elsewhere must be refused",
                       lambda state=state: attn.step(q, k, v, state))
        c.expect_error(f"forward(q, k, v, causal=True, state={what})", InvalidInputError,
                       "a state from elsewhere must be refused",
                       lambda state=state: attn(q, k, v, causal=True, state=state, return_state=True))
    return "not tested: " + "; ".join(notes) if notes else ""
