"""Checks of how an implementation meets PyTorch's execution modes: ``inference_mode``, ``autocast``, activation
checkpointing, ``torch.func`` transforms."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from .aux_losses import training_step
from .config import DTYPE_NAMES, ConformanceConfig
from .context import Ctx, grad_names, noise_like, seeded


def check_inference_mode(cfg: ConformanceConfig) -> None:
    """Under ``torch.inference_mode`` the output equals a ``no_grad`` call's, and the same instance (with the
    same mask objects) then trains and evaluates again.

    A validation pass under ``inference_mode`` between training steps is ordinary PyTorch; a cache it fills
    (plans, block indices, tables, reused buffers) with *inference tensors* breaks the next training step
    (autograd cannot save them for backward) or the next call that writes the buffer in place. Build caches in
    :func:`attnkit.caching.kept_tensors`. Per case (the generator's plain, padding and mask-object cases, float32
    or the precise dtype): one call under ``inference_mode``, one under ``no_grad`` (equal on CPU to the bit);
    then in training mode a call with q, k, v requiring gradients and a backward (finite).
    """
    c = Ctx("inference_mode", cfg)
    dt = torch.float32 if "float32" in c.caps.dtypes else c.precise()
    attn = c.build(dtype=dt)
    cases = c.cases(attn, ["plain", "padding", "objects"])
    for n, case in enumerate(cases):
        label = case.describe(dt)
        kw = case.kwargs(dt)
        q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
        with torch.inference_mode(), seeded(cfg.seed + n):
            first = c.call(attn, f"{label}, under torch.inference_mode()", q, k, v, **kw)
        with seeded(cfg.seed + n):
            again = c.call(attn, f"{label}, under torch.no_grad() after an inference_mode call", q, k, v, **kw)
        c.close(again, first.clone(), f"{label}: a no_grad call after an inference_mode call disagrees with it",
                dtype=dt, against="inference_mode output", **c.exact())
    attn.train()
    for n, case in enumerate(cases):
        label = f"{case.describe(dt)}, training mode after inference_mode calls on the same instance"
        q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n, requires_grad=True)
        with seeded(cfg.seed + 7 * n + 1):
            out = c.call(attn, label, q, k, v, grad=True, **case.kwargs(dt))
        c.finite(out, label, "output")
        for name, g in zip(grad_names(attn), c.grads(attn, out, (q, k, v), label, seed=2100 + n)):
            c.finite(g, label, f"gradient of {name}")


def check_autocast(cfg: ConformanceConfig) -> None:
    """Under ``torch.autocast`` (the device's type, its default dtype: bfloat16 on CPU, float16 on CUDA) float32
    inputs give exactly what the same inputs cast to the autocast dtype give outside it, in that dtype, as SDPA
    does; their gradients arrive in float32, finite.

    An implementation that does not declare the autocast dtype runs in float32 (the output equals the float32
    call's). Cases: the generator's plain and padding cases (each declared causal mode).
    """
    c = Ctx("autocast", cfg)
    if "float32" not in c.caps.dtypes:
        c.skip("the spec does not declare float32, the dtype autocast casts from")
    kind = c.device.type
    try:
        with torch.autocast(kind):
            amp = torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError, ValueError) as exc:
        c.skip(f"torch.autocast({kind!r}) is not available here: {exc}")
    want = amp if DTYPE_NAMES.get(amp) in c.caps.dtypes else torch.float32
    attn = c.build(dtype=torch.float32)
    for n, case in enumerate(c.cases(attn, ["plain", "padding"])):
        label = f"{case.describe(torch.float32)}, under torch.autocast({kind!r}, dtype={amp})"
        kw = case.kwargs(torch.float32)
        q, k, v = c.inputs(case.L, case.S, torch.float32, seed_offset=n, requires_grad=True)
        with torch.autocast(kind), seeded(cfg.seed + n):
            out = c.call(attn, label, q, k, v, grad=True, **kw)
        if out.dtype != want:
            c.fail(f"{label}: output dtype {out.dtype}, expected {want} (the autocast dtype"
                   + (")" if want == amp else f" is not declared, so float32; the spec declares {c.caps.dtypes})"))
        cast = [t.detach().to(want).requires_grad_(True) for t in (q, k, v)]
        with seeded(cfg.seed + n):
            ref = c.call(attn, f"{case.describe(want)} (outside autocast)", *cast, grad=True, **case.kwargs(want))
        c.close(out, ref, f"{label}: differs from the inputs cast to {want} outside autocast", dtype=want,
                against=f"{DTYPE_NAMES.get(want)} inputs outside autocast", **c.exact())
        for name, g in zip(grad_names(attn), c.grads(attn, out, (q, k, v), label, seed=2200 + n)):
            if g is not None and g.dtype != torch.float32:
                c.fail(f"{label}: the gradient of {name} has dtype {g.dtype}, expected float32 (its tensor's)")
            c.finite(g, label, f"gradient of {name}")


def check_checkpointing(cfg: ConformanceConfig) -> None:
    """Under ``torch.utils.checkpoint(use_reentrant=False)`` two training steps in a row give what they give
    without it: the outputs, the auxiliary losses, the gradients of q, k, v and of the parameters, and the
    buffers after each step.

    Checkpointing runs the forward again during backward to rebuild what it saved: a backward that reads
    ``ctx.saved_tensors`` twice fails there ("Unpack is being triggered for a tensor that was already unpacked
    once"); a forward that changes state in training (an EMA update) must record and update once and route the
    recomputation with the state the first run saw (:func:`attnkit.recompute.recomputing`). Cases: the
    generator's plain and padding cases (each declared causal mode), the precise dtype, each backend that trains
    and runs here (the default one when the factory takes no ``backend``), two copies of one freshly built module
    in training mode, the same random seed on both sides.
    """
    c = Ctx("checkpointing", cfg)
    dt = c.precise()
    backends, _ = c.backends()
    for backend in [b for b in backends if c.trains(b)]:
        _checkpointed_steps(c, dt, backend)


def _checkpointed_steps(c: Ctx, dt: torch.dtype, backend: str | None) -> None:
    base = c.build(dtype=dt, backend=backend).train()
    on = "" if backend is None else f", backend={backend!r}"
    for n, case in enumerate(c.cases(base, ["plain", "padding"])):
        kw = case.kwargs(dt)
        inputs = c.inputs(case.L, case.S, dt, seed_offset=n)
        plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
        for rep in range(2):
            label = f"{case.describe(dt)}{on}, training mode, step {rep + 1}"
            what = f"{label}, under torch.utils.checkpoint(use_reentrant=False)"
            out, aux, g = training_step(c, plain, label, inputs, kw, seed=40 * n + rep)
            out_c, aux_c, g_c = training_step(c, ckpt, label, inputs, kw, checkpointed=True, seed=40 * n + rep)
            c.close(out_c, out, what, dtype=dt, against="the plain step's output")
            if sorted(aux_c) != sorted(aux):
                c.fail(f"{what}: recorded the auxiliary losses {sorted(aux_c)}, the plain step {sorted(aux)}")
            for name in aux:
                c.close(aux_c[name].detach(), aux[name].detach(), what, dtype=dt, what=f"auxiliary loss {name!r}",
                        against="the plain step's")
            left = ckpt.pending_aux_losses()
            if left:
                c.fail(f"{what}: {sorted(left)} recorded again while backward recomputed the forward")
            for i, (a, b) in enumerate(zip(g_c, g)):
                if (a is None) != (b is None):
                    c.fail(f"{what}: gradient {i} (q, k, v, then parameters) is "
                           f"{'missing' if a is None else 'present'} here, not in the plain step")
                if a is not None and b is not None:
                    c.close(a, b, what, dtype=dt, what=f"gradient {i} (q, k, v, then parameters)",
                            against="the plain step's")
            mine = dict(ckpt.named_buffers())
            for name, b in plain.named_buffers():
                if b is not None and mine.get(name) is not None and mine[name].shape == b.shape:
                    c.close(mine[name], b, what, dtype=dt, what=f"buffer {name!r} after the step",
                            against="the plain step's")


def check_func_transforms(cfg: ConformanceConfig) -> str | None:
    """``torch.func`` transforms: each one the spec declares (``Capabilities.func_transforms``) gives what
    autograd or a loop gives; each one it does not declare is refused with ``UnsupportedFeatureError``.

    ``grad``: ``torch.func.grad`` of ``(out · g).sum()`` with respect to q, k, v equals autograd's gradients (10x
    the dtype's tolerance: ``auto`` runs the ``torch`` backend under a transform, autograd the default one).
    ``vmap``: over a new leading dimension of two input sets, equal to the two calls stacked. ``jvp``: the
    directional derivative along random tangents equals the central difference (step 1e-6, to 1e-6 + 1e-5·|value|,
    float64 only), and the same derivative with dual tensors of ``torch.autograd.forward_ad`` (inputs with and
    without ``requires_grad``, the module's own backend choice) equals it: the output must carry a tangent.
    Cases: the generator's plain and padding cases (each declared causal mode), the precise dtype, eval mode.

    With ``grad`` declared, also a training step the ``torch.func`` way (the last causal mode, plain and padding
    cases): the module in training mode, its buffers passed in (``torch.func.functional_call``: an update such as
    an EMA writes them), ``grad`` of ``(out · g).sum()`` plus the auxiliary losses collected inside, equal to
    autograd's gradients on a twin module (same seed, same starting buffers), and the buffers after the step equal
    to the twin's. After each transformed call no attribute of any submodule (nor what a list, tuple, dict, deque
    or object in one holds: a mask, a plan) may hold a tensor made under the transform (its wrapper outlives it
    without storage: a later export or kernel fails).

    With ``vmap`` declared, the padding cases also run with the key padding mask batched too (each vmapped sample
    its own mask: per-sample gradients with each sample's padding), and with ``attn_mask`` declared the tensor-mask
    cases with the ``attn_mask`` batched (bool and additive; a shared key padding mask beside one), each equal to
    the two calls stacked; a clear refusal (``UnsupportedFeatureError``) passes and is named in the note.

    With all three declared, nested transforms: ``torch.func.hessian`` (``jacfwd(jacrev(...))``) of
    ``out.square().sum()`` w.r.t. q (float64, B = 1 and the configured shapes, the last causal mode) times a random
    direction equals the central difference of ``torch.func.grad`` (step 1e-5, to 1e-7 + 1e-5·|value|); those
    ``grad`` calls run after the hessian, where a value a nested transform left on the module fails.
    """
    c = Ctx("func_transforms", cfg)
    declared = c.caps.func_transforms
    dt = c.precise()
    attn = c.build(dtype=dt)
    cases = c.cases(attn, ["plain", "padding"])
    refused: list[str] = []
    for name in ("grad", "vmap", "jvp"):
        for n, case in enumerate(cases if name in declared else cases[:1]):
            _transform_case(c, attn, name, case, n, dt)
            if name == "vmap" and name in declared and isinstance(case.kw.get("key_padding_mask"), torch.Tensor):
                refused += _batched_mask_case(c, attn, case, n, dt, "key_padding_mask")
    if "vmap" in declared and c.caps.attn_mask:
        for n, case in enumerate(c.cases(attn, ["tensor"])):
            refused += _batched_mask_case(c, attn, case, 30 + n, dt, "attn_mask")
    if {"grad", "vmap", "jvp"} <= set(declared) and dt == torch.float64:
        _hessian_case(c, dt)
    if "grad" in declared:
        train = c.build(dtype=dt).train()
        for n, case in enumerate(c.cases(train, ["plain", "padding"], causal_modes=c.causal_modes()[-1:])):
            _training_grad_case(c, train, case, 50 + n, dt)
    if refused:
        return f"vmap with a batched mask refused (UnsupportedFeatureError): {refused[0]}"
    return None


def _hessian_case(c: Ctx, dt: torch.dtype) -> None:
    from torch.func import grad, hessian

    from .context import make_inputs

    attn = c.build(dtype=dt)   # (the configured options and shapes: they may fix the heads or limit the length)
    causal = c.causal_modes()[-1]
    q, k, v = make_inputs(1, c.H, c.L, c.L, c.D, c.E, dtype=dt, device=c.device, seed=c.cfg.seed * 1000 + 2900)
    label = f"causal={causal}, (B, H, L, D) = {(1, c.H, c.L, c.D)}, dtype=float64"

    def f(a: torch.Tensor) -> torch.Tensor:
        return attn(a, k, v, causal=causal).square().sum()

    try:
        H = hessian(f)(q).reshape(q.numel(), q.numel())
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: torch.func.hessian (grad, vmap and jvp declared) raised {type(exc).__name__}: {exc}")
    _no_wrapper_kept(c, attn, f"{label}, under torch.func.hessian")
    d = noise_like(q, c.cfg.seed + 2901, scale=1.0)
    eps = 1e-5
    try:
        fd = (grad(f)(q + eps * d) - grad(f)(q - eps * d)) / (2 * eps)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label}: torch.func.grad after a torch.func.hessian call raised {type(exc).__name__}: {exc} (a "
               "value made under the nested transforms was kept on the module or in a cache)")
    c.close((H @ d.flatten()).reshape(q.shape), fd, f"{label}, torch.func.hessian times a direction", dtype=dt,
            what="H·d", against="the central difference of torch.func.grad", atol=1e-7, rtol=1e-5)


def _batched_mask_case(c: Ctx, attn: Any, case: Any, n: int, dt: torch.dtype, key: str) -> list[str]:
    """vmap over two input sets and two masks given as ``key``: the case's, and a second one (a key padding mask
    flipped, padding first; an ``attn_mask`` with its batch rows rolled by one, or flipped over the keys when
    B = 1). The case's other masks stay shared."""
    from torch.func import vmap

    from ..errors import UnsupportedFeatureError

    cfg = c.cfg
    atol, rtol = c.tol(dt, 10.0)
    kw = case.kwargs(dt)
    first = kw.pop(key)
    second = first.roll(1, 0) if key == "attn_mask" and first.shape[0] > 1 else first.flip(-1)
    masks = torch.stack([first, second])
    label = f"{case.describe(dt)}, under torch.func.vmap with the {key} batched too"
    q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
    pair = [torch.stack([t, noise_like(t, cfg.seed + 2800 + n)]) for t in (q, k, v)]
    try:
        with seeded(cfg.seed + n):
            out = vmap(lambda a, b, d, m: attn(a, b, d, **{key: m}, **kw))(*pair, masks)
    except UnsupportedFeatureError as exc:
        return [str(exc)]
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label} (vmap declared in Capabilities.func_transforms) raised {type(exc).__name__}: {exc}; "
               "support it or refuse it with attnkit.errors.UnsupportedFeatureError")
    _no_wrapper_kept(c, attn, label)
    with seeded(cfg.seed + n):
        want = torch.stack([attn(*(t[i] for t in pair), **{key: masks[i]}, **kw) for i in range(2)])
    c.close(out, want, label, dtype=dt, against="the two calls stacked", atol=atol, rtol=rtol)
    return []


def _training_grad_case(c: Ctx, attn: Any, case: Any, n: int, dt: torch.dtype) -> None:
    from torch.func import functional_call, grad

    from ..aux import aux_losses, clear_aux_losses

    cfg = c.cfg
    atol, rtol = c.tol(dt, 10.0)
    kw = case.kwargs(dt)
    label = f"{case.describe(dt)}, training mode, torch.func.grad with the buffers passed in (functional_call)"
    q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
    g = noise_like(torch.empty(*q.shape[:3], v.shape[-1], dtype=dt, device=c.device), cfg.seed + 2700 + n)
    start = {name: b.detach().clone() for name, b in attn.named_buffers()}
    twin = c.build(dtype=dt).train()
    twin.load_state_dict(attn.state_dict())
    for name, b in twin.named_buffers():
        b.copy_(start[name])
    clear_aux_losses(attn)
    clear_aux_losses(twin)

    def loss(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        out = functional_call(attn, buffers, (a, b, d), kw)
        return (out * g).sum() + sum(aux_losses(attn).values())

    buffers = {name: t.clone() for name, t in start.items()}
    try:
        with seeded(cfg.seed + n):
            got = grad(loss, argnums=(0, 1, 2))(q, k, v, buffers)
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label} (grad declared in Capabilities.func_transforms) raised {type(exc).__name__}: {exc}")
    _no_wrapper_kept(c, attn, label)
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with seeded(cfg.seed + n):
        total = (twin(*x, **kw) * g).sum() + sum(aux_losses(twin).values())
    want = torch.autograd.grad(total, x)
    for which, a, b in zip("qkv", got, want):
        c.close(a, b, label, dtype=dt, what=f"gradient of {which}", against="autograd's (a twin module)",
                atol=atol, rtol=rtol)
    for name, b in twin.named_buffers():
        c.close(buffers[name], b, label, dtype=dt, what=f"buffer {name!r} after the step",
                against="the twin's after autograd's step", atol=atol, rtol=rtol)
    with torch.no_grad():
        for name, b in attn.named_buffers():
            b.copy_(buffers[name])


def _no_wrapper_kept(c: Ctx, attn: Any, when: str) -> None:
    """Fail when an attribute of a submodule holds a ``torch.func`` wrapper after the transforms of ``when``."""
    import collections

    from ..aux import _STATE_KEYS
    from ..caching import tensors_in

    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for mname, module in attn.named_modules():
        # (auxiliary-loss records a transform leaves are dropped at the module's next record or collection)
        for key, value in vars(module).items():
            if key in _STATE_KEYS or key == "_modules":
                continue
            path = f"{mname or type(attn).__name__}.{key}"
            todo = [(path, value)]
            while todo:
                where, x = todo.pop()
                if isinstance(x, dict):
                    todo.extend((f"{where}[{k!r}]", y) for k, y in x.items())
                elif isinstance(x, (list, tuple, collections.deque)):
                    todo.extend((f"{where}[{i}]", y) for i, y in enumerate(x))
                elif any(wrapped(t) for t in tensors_in(x)):   # a tensor, or one held by an object (a mask, a plan)
                    c.fail(f"{when}: afterwards the module keeps a tensor made under the transform in "
                           f"{where}{'' if isinstance(x, torch.Tensor) else ' (held by it)'}: its wrapper, which "
                           "outlives it without storage (a later torch.export or kernel reading it fails); keep "
                           "such values only when attnkit.caching.may_keep() is True (attnkit.caching.cached "
                           "does)")


def _transform_case(c: Ctx, attn: Any, name: str, case: Any, n: int, dt: torch.dtype) -> None:
    from torch.func import grad, jvp, vmap

    from ..errors import UnsupportedFeatureError

    cfg = c.cfg
    declared = c.caps.func_transforms
    atol, rtol = c.tol(dt, 10.0)
    kw = case.kwargs(dt)
    label = f"{case.describe(dt)}, under torch.func.{name}"
    q, k, v = c.inputs(case.L, case.S, dt, seed_offset=n)
    g = noise_like(torch.empty(*q.shape[:3], v.shape[-1], dtype=dt, device=c.device), cfg.seed + 2400 + n)

    def loss(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return (attn(a, b, d, **kw) * g).sum()

    def run() -> tuple[torch.Tensor, ...]:
        with seeded(cfg.seed + n):
            if name == "grad":
                return grad(loss, argnums=(0, 1, 2))(q, k, v)
            if name == "vmap":
                pair = [torch.stack([t, noise_like(t, cfg.seed + 2500 + n)]) for t in (q, k, v)]
                return vmap(lambda a, b, d: attn(a, b, d, **kw))(*pair), *pair
            tangents = tuple(noise_like(t, cfg.seed + 2600 + n) for t in (q, k, v))
            with warnings.catch_warnings():   # torch's forward AD loads its decompositions with torch.jit.script
                warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
                return jvp(loss, (q, k, v), tangents)[1], *tangents

    if name not in declared:
        c.expect_error(label, UnsupportedFeatureError, f"not declared in Capabilities.func_transforms {declared} "
                       "(declare it, and this check compares it, or refuse it)", run)
        return
    try:
        got = run()
    except Exception as exc:  # noqa: BLE001
        c.fail(f"{label} (declared in Capabilities.func_transforms {declared}) raised {type(exc).__name__}: {exc}")
    _no_wrapper_kept(c, attn, label)
    if name == "grad":
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with seeded(cfg.seed + n):
            want = torch.autograd.grad(loss(*x), x)
        for which, a, b in zip("qkv", got, want):
            c.close(a, b, label, dtype=dt, what=f"gradient of {which}", against="autograd's", atol=atol, rtol=rtol)
    elif name == "vmap":
        out, pq, pk, pv = got
        with seeded(cfg.seed + n):
            want = torch.stack([attn(pq[i], pk[i], pv[i], **kw) for i in range(2)])
        c.close(out, want, label, dtype=dt, against="the two calls stacked", atol=atol, rtol=rtol)
    else:
        if dt != torch.float64:
            c.skip("jvp is compared with a central difference, which needs float64")
        d, tq, tk, tv = got
        eps = 1e-6
        with torch.no_grad(), seeded(cfg.seed + n):
            plus = loss(q + eps * tq, k + eps * tk, v + eps * tv)
        with torch.no_grad(), seeded(cfg.seed + n):
            minus = loss(q - eps * tq, k - eps * tk, v - eps * tv)
        c.close(d, (plus - minus) / (2 * eps), label, dtype=dt, what="directional derivative",
                against="the central difference", atol=1e-6, rtol=1e-5)
        _dual_case(c, attn, case, kw, (q, k, v), (tq, tk, tv), g, d, n, dt)


def _dual_case(c: Ctx, attn: Any, case: Any, kw: dict[str, Any], xs: tuple[torch.Tensor, ...],
               tangents: tuple[torch.Tensor, ...], g: torch.Tensor, want: torch.Tensor, n: int,
               dt: torch.dtype) -> None:
    """The same directional derivative with dual tensors of ``torch.autograd.forward_ad`` (the module as built,
    inputs that also need gradients): the output must carry the tangent (a fused path that drops it gives an
    output without one) and agree with ``torch.func.jvp``'s."""
    import torch.autograd.forward_ad as fwAD

    atol, rtol = c.tol(dt, 10.0)
    for needs_grad in (False, True):
        label = f"{case.describe(dt)}, with dual tensors (torch.autograd.forward_ad, requires_grad={needs_grad})"
        try:
            with warnings.catch_warnings(), seeded(c.cfg.seed + n), fwAD.dual_level():
                warnings.filterwarnings("ignore", r".*torch\.jit\.script.* is deprecated", DeprecationWarning)
                duals = [fwAD.make_dual(t.clone().requires_grad_(needs_grad), tt)
                         for t, tt in zip(xs, tangents, strict=True)]
                tangent = fwAD.unpack_dual(attn(*duals, **kw)).tangent
        except Exception as exc:  # noqa: BLE001
            c.fail(f"{label} (jvp declared) raised {type(exc).__name__}: {exc}")
        if tangent is None:
            c.fail(f"{label}: the output carries no tangent (a path that does not propagate forward-mode "
                   "derivatives ran on dual tensors; under them the torch backend must run, as under torch.func.jvp)")
        c.close((tangent * g).sum(), want, label, dtype=dt, what="directional derivative",
                against="torch.func.jvp's", atol=atol, rtol=rtol)
