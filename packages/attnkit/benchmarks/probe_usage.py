"""Ways users call attention that the conformance kit does not (or did not) try, on every installed implementation
and every backend that runs here (docs/conformance.md, "Probes beyond the kit").

Each probe prints one line per implementation: ``OK`` or what differed or raised. Eval mode unless said, float64
where declared, the kit's shapes (``ConformanceConfig(name)``: B = 2, H = 2, L = 9, D = E = 8 by default):

* ``compile``: ``torch.compile(backend="aot_eager")`` of the module, eval and training, with and without key
  padding, forward and backward plus the auxiliary losses, against a twin module eagerly (same seed, same
  buffers; buffers compared after), then the compiled module's original called eagerly again;
* ``inductor``: the same with ``torch.compile``'s default backend (Inductor: generated C++ kernels on the CPU; the
  fused numba and custom-operator paths run at graph breaks or as opaque operators); about 20-60 s per
  implementation on 2 cores;
* ``lengths``: one ``torch.compile(backend="aot_eager")`` module at four lengths (dynamic after the second),
  eval, with padding, against eager;
* ``inductor_lengths``: the same with Inductor;
* ``fullgraph``: ``torch.compile(backend="eager", fullgraph=True)`` of each backend, eval and training, float32,
  with padding: one graph, or the first cause of a graph break (in parentheses: information, not a finding);
* ``anomaly``: forward and backward under ``torch.autograd.detect_anomaly(check_nan=True)``, training mode,
  each causal mode, no padding, some padding, a batch row fully padded (a NaN made and then masked in backward
  raises there);
* ``threads``: one module called from four Python threads at once (lengths 24-48, float32 where declared)
  against sequential calls;
* ``deterministic``: under ``torch.use_deterministic_algorithms(True)``, forward and backward three times on the
  same inputs (each backend that trains, L = 130 where taken, padding): bit for bit the same, nothing refused;
* ``partial_grad``: gradients when only some of q, k, v require them against all three;
* ``inplace``: the output modified in place (``out.mul_(2)``: an in-place dropout or activation) before the
  backward pass, against ``2 * out``: each backend that trains, each causal mode, with padding; a finding is a
  wrong gradient; autograd's refusal is information (SDPA's float32 CPU kernel saves its output and refuses
  the same);
* ``per_sample``: per-sample gradients ``vmap(grad(loss))`` over the batch with each sample's key padding mask,
  w.r.t. the parameters and q, against one autograd call per sample (implementations declaring grad and vmap);
* ``jacobian``: ``jacrev`` (grad declared) and ``jacfwd`` (jvp declared) of the output w.r.t. q, B = 1, L = 5,
  against the Jacobian built row by row with autograd;
* ``dual``: forward-mode AD with dual tensors (``torch.autograd.forward_ad``), q dual with and without
  ``requires_grad``, ``auto`` and each backend, against ``torch.func.jvp`` (implementations declaring ``jvp``);
* ``hessian``: ``torch.func.hessian`` of ``out.square().sum()`` w.r.t. q (grad, vmap and jvp declared; B = 1,
  L = 4, D = 2) times a random direction, against the central difference of ``torch.func.grad`` (step 1e-5);
* ``dims``: each non-torch CPU backend against ``torch`` at head dims 72 / 160 / 256 / 5 (value dims 24 / 200 /
  64 / 3) and lengths 150 / 97 / 70 / 130 (several blocks, ragged), forward and gradients.

A refusal (``attnkit.UnsupportedFeatureError``) is reported as such::

    python packages/attnkit/benchmarks/probe_usage.py [--probe NAME ...] [--only IMPL ...]
"""

from __future__ import annotations

import argparse
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

import attnkit
from attnkit.errors import UnsupportedFeatureError
from attnkit.testing import ConformanceConfig
from attnkit.testing.cases import padding_mask
from attnkit.testing.context import Ctx, seeded


def _max_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None:
            worst = max(worst, (x - y).abs().max().item())
    return worst


def probe_compile(name: str, backend: str = "aot_eager") -> list[str]:
    import torch._dynamo

    c = Ctx("probe", ConformanceConfig(name=name))
    dt = c.precise()
    causal = c.causal_modes()[-1]
    msgs = []
    for mode in ("eval", "train"):
        torch._dynamo.reset()
        a, b = c.build(dtype=dt).train(mode == "train"), c.build(dtype=dt).train(mode == "train")
        compiled = torch.compile(a, backend=backend)
        q, k, v = c.inputs(c.L, c.L, dt)
        for kpm in (None, padding_mask(c.B, c.L, c.device) if c.caps.key_padding_mask else None):
            xs, ys = ([t.clone().requires_grad_(True) for t in (q, k, v)] for _ in range(2))
            try:
                with seeded(5):
                    o1 = compiled(*xs, causal=causal, key_padding_mask=kpm)
                g1 = torch.autograd.grad(o1.square().sum() + sum(attnkit.aux_losses(a).values()), xs, allow_unused=True)
            except Exception as exc:  # noqa: BLE001
                msgs.append(f"{mode}, padding={kpm is not None}: compiled raised {type(exc).__name__}: {exc}"[:300])
                continue
            with seeded(5):
                o2 = b(*ys, causal=causal, key_padding_mask=kpm)
            g2 = torch.autograd.grad(o2.square().sum() + sum(attnkit.aux_losses(b).values()), ys, allow_unused=True)
            bufs = _max_diff([p for p in a.buffers() if p.is_floating_point()],
                             [p for p in b.buffers() if p.is_floating_point()])
            d, gd = _max_diff([o1], [o2]), _max_diff(list(g1), list(g2))
            if d > 1e-9 or gd > 1e-8 or bufs > 1e-9:
                msgs.append(f"{mode}, padding={kpm is not None}: output {d:.1e}, gradients {gd:.1e}, "
                            f"buffers {bufs:.1e}")
        try:
            a(q, k, v, causal=causal)
        except Exception as exc:  # noqa: BLE001
            msgs.append(f"{mode}: eager after compiling raised {type(exc).__name__}: {exc}"[:300])
    return msgs


def probe_lengths(name: str, backend: str = "aot_eager") -> list[str]:
    """One ``torch.compile(backend=backend)`` module called at four lengths (Dynamo marks the length dynamic
    after the second), eval, with padding, against the module eagerly."""
    import torch._dynamo

    c = Ctx("probe", ConformanceConfig(name=name))
    dt = c.precise()
    causal = c.causal_modes()[-1]
    torch._dynamo.reset()
    attn = c.build(dtype=dt).eval()
    compiled = torch.compile(attn, backend=backend)
    limits = getattr(attn, "limits", None)
    lengths = [n for n in range(c.L, 6 * c.L) if limits is None or limits.why_not(n, n) is None][::5][:4]
    msgs = []
    for i, L in enumerate(lengths):
        q, k, v = c.inputs(L, L, dt, seed_offset=i)
        kpm = padding_mask(c.B, L, c.device) if c.caps.key_padding_mask else None
        try:
            with torch.no_grad():
                d = _max_diff([compiled(q, k, v, causal=causal, key_padding_mask=kpm)],
                              [attn(q, k, v, causal=causal, key_padding_mask=kpm)])
        except Exception as exc:  # noqa: BLE001
            msgs.append(f"L={L}: compiled raised {type(exc).__name__}: {exc}"[:300])
            continue
        if d > 1e-9:
            msgs.append(f"L={L}: output {d:.1e}")
    return msgs


def probe_fullgraph(name: str) -> list[str]:
    """Whether each backend compiles to one graph: ``torch.compile(backend="eager", fullgraph=True)``, float32,
    eval and training, with padding. A graph break is no defect (the module then runs in several graphs, as the
    ``compile`` probe checks); the line names its first cause, in parentheses."""
    import torch._dynamo

    c = Ctx("probe", ConformanceConfig(name=name))
    causal = c.causal_modes()[-1]
    runnable, _ = c.backends()
    msgs = []
    for backend in runnable:
        for mode in ("eval", "train"):
            torch._dynamo.reset()
            attn = c.build(dtype=torch.float32, backend=backend).train(mode == "train")
            compiled = torch.compile(attn, backend="eager", fullgraph=True)
            q, k, v = c.inputs(c.L, c.L, torch.float32)
            kpm = padding_mask(c.B, c.L, c.device) if c.caps.key_padding_mask else None
            try:
                compiled(q, k, v, causal=causal, key_padding_mask=kpm)
            except Exception as exc:  # noqa: BLE001
                lines = str(exc).splitlines()
                where = next((ln.strip() for ln in reversed(lines) if ln.strip().startswith("File ")), "")
                msgs.append(f"({backend}, {mode}: graph break: {lines[0][:90]} {where[-90:]})")
            finally:
                attnkit.clear_aux_losses(attn)
    return msgs


def _training_backends(name: str, float32: bool = False) -> Iterator[tuple[Ctx, str | None, torch.nn.Module,
                                                                            torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(ctx, backend, module, q, k, v)`` for each backend of ``name`` that runs here and trains (the precise
    dtype, or float32 where declared with ``float32``; the kit's shapes)."""
    c = Ctx("probe", ConformanceConfig(name=name))
    dt = torch.float32 if float32 and "float32" in c.caps.dtypes else c.precise()
    runnable, _ = c.backends()
    for backend in runnable:
        if c.trains(backend):
            yield (c, backend, c.build(dtype=dt, backend=backend), *c.inputs(c.L, c.L, dt))


def probe_anomaly(name: str) -> list[str]:
    msgs = []
    for c, backend, attn, q, k, v in _training_backends(name):
        attn.train()
        masks: list[torch.Tensor | None] = [None]
        if c.caps.key_padding_mask:
            some = padding_mask(c.B, c.L, c.device).clone()
            full = some.clone()
            full[0] = False
            masks += [some, full]
        for causal in c.causal_modes():
            for kpm in masks:
                xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
                try:
                    with torch.autograd.detect_anomaly(check_nan=True):
                        out = attn(*xs, causal=causal, key_padding_mask=kpm)
                        (out.square().sum() + sum(attnkit.aux_losses(attn).values())).backward()
                except Exception as exc:  # noqa: BLE001
                    msgs.append(f"{backend}, causal={causal}, padding={kpm is not None}: {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0]}"[:200])
    return msgs


def probe_threads(name: str) -> list[str]:
    c = Ctx("probe", ConformanceConfig(name=name))
    dt = torch.float32 if "float32" in c.caps.dtypes else c.precise()
    runnable, _ = c.backends()
    msgs = []
    for backend in runnable:
        attn = c.build(dtype=dt, backend=backend).eval()
        causal = c.causal_modes()[-1]
        inputs = [c.inputs(24 + 8 * i, 24 + 8 * i, dt, seed_offset=i) for i in range(4)]
        with torch.no_grad():
            want = [attn(*x, causal=causal) for x in inputs]
        got, errors = _threaded_calls(attn, inputs, causal)
        if errors:
            msgs.append(f"{backend}: {errors[0]}")
        elif (d := max(_max_diff([got[t][j]], [want[j]]) for t in range(4) for j in range(4))) > 1e-5:
            msgs.append(f"{backend}: threaded calls differ by {d:.1e}")
    return msgs


def probe_deterministic(name: str) -> list[str]:
    """Under ``torch.use_deterministic_algorithms(True)``: forward and backward three times on the same inputs
    (each backend that trains, float32 where declared, L = 130 where the implementation takes it, else the kit's
    length; padding where declared; training mode off): the outputs and gradients bit for bit the same, and no
    operation refused."""
    from attnkit.errors import InvalidInputError

    msgs = []
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for c, backend, attn, q0, _k, _v in _training_backends(name, float32=True):
            dt = q0.dtype
            attn.eval()
            causal = c.causal_modes()[-1]
            runs = []
            for L in (130, c.L):
                q, k, v = c.inputs(L, L, dt)
                kpm = padding_mask(c.B, L, c.device) if c.caps.key_padding_mask else None
                try:
                    for _ in range(3):
                        xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
                        out = attn(*xs, causal=causal, key_padding_mask=kpm)
                        out.square().sum().backward()
                        runs.append([out.detach(), *(x.grad for x in xs)])
                    break
                except (UnsupportedFeatureError, InvalidInputError):
                    runs = []          # a length it does not take: the kit's
                except Exception as exc:  # noqa: BLE001
                    msgs.append(f"{backend}: {type(exc).__name__}: {str(exc).splitlines()[0]}"[:200])
                    runs = []
                    break
            for r in runs[1:]:
                if not all(torch.equal(a, b) for a, b in zip(runs[0], r, strict=True)):
                    d = _max_diff(r, runs[0])
                    msgs.append(f"{backend}: runs differ (largest {d:.1e}) under deterministic algorithms")
                    break
    finally:
        torch.use_deterministic_algorithms(was)
    return msgs


def _threaded_calls(attn: torch.nn.Module, inputs: list, causal: bool) -> tuple[list[list], list[str]]:
    """Four threads, each calling ``attn`` on every input five times (in a different order): outputs, errors."""
    got: list[list[torch.Tensor | None]] = [[None] * len(inputs) for _ in range(4)]
    errors: list[str] = []

    def work(t: int) -> None:
        try:
            for _ in range(5):
                for i in range(len(inputs)):
                    j = (i + t) % len(inputs)
                    with torch.no_grad():
                        got[t][j] = attn(*inputs[j], causal=causal)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    workers = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return got, errors


def probe_partial_grad(name: str) -> list[str]:
    msgs = []
    for c, backend, attn, q, k, v in _training_backends(name):
        kpm = padding_mask(c.B, c.L, c.device) if c.caps.key_padding_mask else None
        causal = c.causal_modes()[-1]
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = torch.autograd.grad(attn(*full, causal=causal, key_padding_mask=kpm).square().sum(), full)
        for which in ((0,), (1,), (2,), (0, 2), (1, 2)):
            xs = [t.clone().requires_grad_(i in which) for i, t in enumerate((q, k, v))]
            try:
                got = torch.autograd.grad(attn(*xs, causal=causal, key_padding_mask=kpm).square().sum(),
                                          [xs[i] for i in which])
            except Exception as exc:  # noqa: BLE001
                msgs.append(f"{backend}, gradients of {'qkv'[which[0]]}...: {type(exc).__name__}: {exc}"[:200])
                continue
            if (d := _max_diff(list(got), [want[i] for i in which])) > 1e-9:
                msgs.append(f"{backend}, gradients of {''.join('qkv'[i] for i in which)} alone differ by {d:.1e}")
    return msgs


def probe_inplace(name: str) -> list[str]:
    """The output modified in place (``out.mul_(2)``, as an in-place dropout does), then a backward pass, against
    the out-of-place ``2 * out``: each backend that trains, each causal mode, with padding."""
    msgs = []
    for c, backend, attn, q, k, v in _training_backends(name):
        kpm = padding_mask(c.B, c.L, c.device) if c.caps.key_padding_mask else None
        for causal in c.causal_modes():
            xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
            want = torch.autograd.grad((2 * attn(*xs, causal=causal, key_padding_mask=kpm)).square().sum(), xs)
            try:
                out = attn(*xs, causal=causal, key_padding_mask=kpm)
                out.mul_(2)
                got = torch.autograd.grad(out.square().sum(), xs)
            except Exception as exc:  # noqa: BLE001
                # autograd's refusal (a saved output modified, a custom function's view): information, as for
                # SDPA, whose float32 CPU kernel saves its output and refuses the same
                msgs.append(f"({backend}, causal={causal}: refused by autograd: {str(exc).splitlines()[0][:90]})")
                continue
            if (d := _max_diff(list(got), list(want))) > 1e-9:
                msgs.append(f"{backend}, causal={causal}: gradients after an in-place op differ by {d:.1e}")
    return msgs


def probe_per_sample(name: str) -> list[str]:
    from torch.func import functional_call, grad, vmap

    if not {"grad", "vmap"} <= set(attnkit.get_spec(name).capabilities.func_transforms):
        return ["(skipped: grad and vmap not both declared)"]
    c = Ctx("probe", ConformanceConfig(name=name))
    dt = c.precise()
    attn = c.build(dtype=dt)
    q, k, v = c.inputs(c.L, c.L, dt)
    causal = c.causal_modes()[-1]
    kpm = padding_mask(c.B, c.L, c.device) if c.caps.key_padding_mask else torch.ones(c.B, c.L, dtype=torch.bool)
    use_kpm = c.caps.key_padding_mask
    params = {n: p.detach() for n, p in attn.named_parameters()}

    def loss(p: dict, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        kw = {"causal": causal, "key_padding_mask": m[None] if use_kpm else None}
        return functional_call(attn, p, (a[None], b[None], d[None]), kw).square().sum()

    try:
        got = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0, 0, 0))(params, q, k, v, kpm)
    except UnsupportedFeatureError as exc:
        return [f"refused: {exc}"[:250]]
    except Exception as exc:  # noqa: BLE001
        return [f"raised {type(exc).__name__}: {exc}"[:250]]
    worst = 0.0
    for i in range(c.B):
        ps = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        a = q[i].clone().requires_grad_(True)
        want = torch.autograd.grad(loss(ps, a, k[i], v[i], kpm[i]), [*ps.values(), a], allow_unused=True)
        want = [torch.zeros_like(x) if w is None else w for x, w in zip([*ps.values(), a], want)]
        worst = max(worst, _max_diff([got[0][n][i] for n in ps] + [got[1][i]], want))
    return [] if worst < 1e-8 else [f"per-sample gradients differ from a loop by {worst:.1e}"]


def _one_sample(name: str, L: int, D: int) -> tuple[Ctx, torch.dtype, torch.nn.Module, torch.Tensor, torch.Tensor,
                                                    torch.Tensor, bool]:
    """``(ctx, dtype, module, q, k, v, causal)``: one head, B = 1, length ``L``, head dim ``D`` (value dim 2), the
    precise dtype and the last causal mode, for the derivative probes."""
    c = Ctx("probe", ConformanceConfig(name=name, shapes=(2, 1, L, L + 1, D, 2)))
    dt = c.precise()
    return (c, dt, c.build(dtype=dt), *c.inputs(L, L, dt, B=1), c.causal_modes()[-1])


def probe_jacobian(name: str) -> list[str]:
    from torch.func import jacfwd, jacrev

    declared = attnkit.get_spec(name).capabilities.func_transforms
    c, dt, attn, q, k, v, causal = _one_sample(name, 5, 3)

    def f(a: torch.Tensor) -> torch.Tensor:
        return attn(a, k, v, causal=causal)

    x = q.clone().requires_grad_(True)
    out = f(x)
    rows = []
    for i in range(out.numel()):
        row, = torch.autograd.grad(out.flatten()[i], x, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros_like(q) if row is None else row)
    want = torch.stack(rows).reshape(*out.shape, *q.shape)
    msgs = []
    for label, fn, needs in (("jacrev", jacrev, "grad"), ("jacfwd", jacfwd, "jvp")):
        if needs not in declared:
            continue
        try:
            if (d := _max_diff([fn(f)(q)], [want])) > 1e-8:
                msgs.append(f"{label} differs by {d:.1e}")
        except UnsupportedFeatureError as exc:
            msgs.append(f"{label} refused: {str(exc).split(':')[0]}")
        except Exception as exc:  # noqa: BLE001
            msgs.append(f"{label} raised {type(exc).__name__}: {exc}"[:200])
    return msgs


def probe_dual(name: str) -> list[str]:
    """Forward-mode AD with dual tensors (``torch.autograd.forward_ad``, not ``torch.func``): q dual, with and
    without ``requires_grad``, ``auto`` and each backend, against ``torch.func.jvp`` (implementations declaring
    ``jvp``; a forced non-torch backend refuses by name, as under ``torch.func.jvp``)."""
    import torch.autograd.forward_ad as fwAD

    if "jvp" not in attnkit.get_spec(name).capabilities.func_transforms:
        return ["(jvp not declared)"]
    c = Ctx("probe", ConformanceConfig(name=name))
    dt = c.precise()
    runnable, _ = c.backends()
    msgs = []
    q, k, v = c.inputs(c.L, c.L, dt)
    causal = c.causal_modes()[-1]
    t = torch.randn_like(q)
    ref = c.build(dtype=dt).eval()                 # "auto": the torch path under torch.func
    _, want = torch.func.jvp(lambda x: ref(x, k, v, causal=causal), (q,), (t,))
    for backend in ("auto", *runnable):
        attn = c.build(dtype=dt, backend=None if backend == "auto" else backend).eval()
        for grad in (False, True):
            try:
                with fwAD.dual_level():
                    out = attn(fwAD.make_dual(q.clone().requires_grad_(grad), t), k, v, causal=causal)
                    got = fwAD.unpack_dual(out).tangent
            except UnsupportedFeatureError as exc:
                msgs.append(f"({backend}, requires_grad={grad}: refused: {str(exc).split(':')[0]})")
                continue
            except Exception as exc:  # noqa: BLE001
                msgs.append(f"{backend}, requires_grad={grad}: {type(exc).__name__}: {str(exc).splitlines()[0]}"[:200])
                continue
            if got is None or (d := _max_diff([got], [want])) > 1e-8:
                msgs.append(f"{backend}, requires_grad={grad}: tangent "
                            + ("missing" if got is None else f"differs by {d:.1e}"))
    return msgs


def probe_hessian(name: str) -> list[str]:
    from torch.func import grad, hessian

    if not {"grad", "vmap", "jvp"} <= set(attnkit.get_spec(name).capabilities.func_transforms):
        return ["(skipped: grad, vmap and jvp not all declared)"]
    c, dt, attn, q, k, v, causal = _one_sample(name, 4, 2)

    def f(a: torch.Tensor) -> torch.Tensor:
        return attn(a, k, v, causal=causal).square().sum()

    try:
        H = hessian(f)(q).reshape(q.numel(), q.numel())
    except UnsupportedFeatureError as exc:
        return [f"refused: {exc}"[:200]]
    except Exception as exc:  # noqa: BLE001
        return [f"raised {type(exc).__name__}: {exc}"[:200]]
    d = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=dt)
    eps = 1e-5
    fd = (grad(f)(q + eps * d) - grad(f)(q - eps * d)) / (2 * eps)
    hd = (H @ d.flatten()).reshape(q.shape)
    err = (fd - hd).abs().max().item()
    return [] if err <= 1e-7 + 1e-5 * hd.abs().max().item() else [f"H·d differs from the difference by {err:.1e}"]


def probe_dims(name: str) -> list[str]:
    spec = attnkit.get_spec(name)
    others = [b for b in spec.capabilities.backends if b not in ("torch", "triton", "flex")]
    if not others or "torch" not in spec.capabilities.backends:
        return ["(skipped: no CPU backend besides torch)"]
    msgs = []
    for D, E, L in ((72, 24, 150), (160, 200, 97), (256, 64, 70), (5, 3, 130)):
        c = Ctx("probe", ConformanceConfig(name=name, shapes=(2, 2, L, L + 1, D, E)))
        dt = c.precise()
        mods = {b: c.build(dtype=dt, backend=b) for b in ["torch", *others]}
        for b in others:
            mods[b].load_state_dict(mods["torch"].state_dict())
        q, k, v = c.inputs(L, L, dt)
        kpm = padding_mask(2, L, c.device) if spec.capabilities.key_padding_mask else None
        for causal in c.causal_modes():
            results = {}
            for b, m in mods.items():
                xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
                try:
                    with seeded(0):
                        o = m(*xs, causal=causal, key_padding_mask=kpm)
                    results[b] = (o.detach(), torch.autograd.grad(o.square().sum(), xs, allow_unused=True))
                except UnsupportedFeatureError:
                    results[b] = None
            base = results["torch"]
            for b in others:
                if base is None or results[b] is None:
                    continue
                scale = base[0].abs().max().item() + 1e-30
                d = _max_diff([results[b][0]], [base[0]]) / scale
                gd = _max_diff(list(results[b][1]), list(base[1]))
                if d > 1e-9 or gd > 1e-6:
                    msgs.append(f"D={D} E={E} L={L} causal={causal} {b}: output {d:.1e} (relative), gradients {gd:.1e}")
    return msgs


PROBES: dict[str, Callable[[str], list[str]]] = {
    "compile": probe_compile, "inductor": lambda name: probe_compile(name, "inductor"), "lengths": probe_lengths,
    "inductor_lengths": lambda name: probe_lengths(name, "inductor"), "fullgraph": probe_fullgraph,
    "anomaly": probe_anomaly, "threads": probe_threads, "deterministic": probe_deterministic,
    "partial_grad": probe_partial_grad, "inplace": probe_inplace, "per_sample": probe_per_sample,
    "jacobian": probe_jacobian, "dual": probe_dual, "hessian": probe_hessian, "dims": probe_dims,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", nargs="+", choices=sorted(PROBES), default=list(PROBES))
    parser.add_argument("--only", nargs="+", default=None, help="implementation names (default: every installed)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    names = args.only or [s.name for s in attnkit.available()]
    for probe in args.probe:
        print(f"== {probe}", flush=True)
        bad = 0
        for name in names:
            try:
                msgs = PROBES[probe](name)
            except Exception as exc:  # noqa: BLE001 - a probe's own failure is a finding too
                msgs = [f"probe raised {type(exc).__name__}: {exc}"[:300]]
            # a line in parentheses (a skip, a graph break) or a clear refusal by name is no finding
            bad += any(not m.startswith("(") and "refused" not in m for m in msgs)
            print(f"{name:20s} {'OK' if not msgs else ' | '.join(msgs)}", flush=True)
        print(f"-- {probe}: {len(names) - bad} of {len(names)} without a finding (skips and refusals by name "
              "count as none)", flush=True)


if __name__ == "__main__":
    main()
