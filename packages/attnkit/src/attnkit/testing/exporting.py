"""The ``torch.export`` checks: an exported program gives the eager output on other inputs of the same shapes
(``export``), and at other lengths when the length is declared dynamic (``export_dynamic``)."""

from __future__ import annotations

import io
import warnings
from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .. import masks as _masks
from ..errors import UnsupportedFeatureError
from ..spec import TRACED_MASK_KINDS
from .cases import additive_bias, document_ids, left_padding_mask, padding_mask, parity_mask
from .config import ConformanceConfig
from .context import Ctx


class _Exported(torch.nn.Module):
    """``attn(q, k, v, causal=...)`` with one mask of ``kind`` built from the last input (None: no mask input)."""

    def __init__(self, attn: Any, causal: bool, kind: str | None) -> None:
        super().__init__()
        self.attn, self.causal, self.kind = attn, causal, kind

    def forward(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor | None = None) -> Tensor:
        if self.kind is None:
            return self.attn(q, k, v, causal=self.causal)
        if self.kind == "key_padding":
            return self.attn(q, k, v, causal=self.causal, key_padding_mask=x)
        if self.kind == "tensor":
            return self.attn(q, k, v, causal=self.causal, attn_mask=x)
        if self.kind == "document":
            return self.attn(q, k, v, causal=self.causal, mask=_masks.document(x))
        keep = x   # "function": a mask function reading the input (a (B, S) bool table of visible keys)
        m = _masks.from_function(lambda b, h, qp, kv: keep[b, kv], name="kit-input", batch_dependent=True)
        return self.attn(q, k, v, causal=self.causal, mask=m)


def _mask_inputs(kind: str, B: int, H: int, L: int, device: Any, dtype: torch.dtype | None = None
                 ) -> tuple[Tensor, Tensor]:
    """Two different masks of ``kind`` for ``(B, H, L, L)``: the one exported with, and another. ``dtype`` (kind
    ``tensor``): additive masks of that dtype instead of bool ones, the first with ``-inf`` where the parity mask
    forbids, the second finite (a program must not keep the form of the first's ``-inf`` count)."""
    if kind in ("key_padding", "function"):
        return padding_mask(B, L, device), left_padding_mask(B, L, device)
    if kind == "tensor" and dtype is not None:
        bias = additive_bias(B, L, L, device).to(dtype)
        return bias.masked_fill(~parity_mask(B, 1, L, L, device), float("-inf")), bias.flip(-1)
    if kind == "tensor":
        first = parity_mask(B, H, L, L, device)
        return first, ~first | (torch.arange(L, device=device) == 0)
    ids = document_ids(B, L, device)
    return ids, ids.flip(-1).neg()


def check_export(cfg: ConformanceConfig) -> None:
    """``torch.export.export`` (non-strict, eval, a freshly built module, the precise dtype): with
    ``Capabilities.export`` the program gives the eager output, to the dtype's tolerance, on inputs other than
    those it was exported with (a value read from the example inputs and baked into the program shows there),
    the eager side being the same module called after the export (a cache it filled during the trace with
    fake tensors fails there); the program is saved and loaded (``torch.export.save`` / ``load``) and run with
    gradients enabled, as a caller would; each declared causal mode. Each mask kind of ``export_masks`` is an
    input of the program (the last declared causal mode; a second mask of that kind is compared too; for
    ``tensor`` also additive float masks, one with ``-inf`` and one finite, and the program must raise on one
    holding NaN, as eager does); each
    tensor mask kind the spec honours but does not declare there, and export itself when not declared, is
    refused with ``UnsupportedFeatureError``. The module is built with ``backend="auto"``; then each backend of
    ``export_backends`` that runs here is forced (no mask input, the last causal mode), and each other backend
    that runs here must be refused. The programs without a mask input are saved and loaded first.

    When the spec declares both ``export`` and ``grad`` (``Capabilities.func_transforms``), first of all a module
    runs ``torch.func.grad`` (each declared causal mode, a length no other case uses, the first from L + 3 the
    instance's limits accept, so no cache holds it yet),
    then its program and a fresh module's at that length are exported, saved, loaded and compared as above (the
    last causal mode): a cache that kept a tensor made under the transform (its wrapper, without storage) fails
    there, as in a training script that exports its model.
    """
    c = Ctx("export", cfg)
    caps = c.caps
    modes = c.causal_modes()
    if caps.export and "grad" in caps.func_transforms:
        _after_grad(c, modes)
    for n, causal in enumerate(modes):
        _export_case(c, causal, None, None, n)
    for n, kind in enumerate(k for k in TRACED_MASK_KINDS if k in caps.mask_kinds):
        _export_case(c, modes[-1], kind, None, 10 + n)
    if "tensor" in caps.export_masks:
        _export_case(c, modes[-1], "tensor", None, 15, additive=True)
    runnable, _ = c.backends()
    for n, backend in enumerate(b for b in runnable if b is not None):
        _export_case(c, modes[-1], None, backend, 20 + n)


def _after_grad(c: Ctx, modes: list[bool]) -> None:
    """Export a module that ran ``torch.func.grad``, and a fresh one after it (caches shared between modules)."""
    from torch.func import grad

    dt = c.precise()
    attn = c.build(dtype=dt).eval()
    limits = getattr(attn, "limits", None)
    L = next((n for n in range(c.L + 3, 4 * c.L + 8) if limits is None or limits.why_not(n, n) is None), c.L)
    q, k, v = c.inputs(L, L, dt, seed_offset=40)
    for causal in modes:
        try:
            grad(lambda a, causal=causal: attn(a, k, v, causal=causal).square().sum())(q)
        except Exception:  # noqa: BLE001
            return   # the func_transforms check reports it
    hint = ("; a cache kept a tensor made under torch.func.grad (the transform's wrapper, without storage): keep "
            "entries only when attnkit.caching.may_keep(), or build them with attnkit.caching.cached")
    for n, (module, which) in enumerate(((attn, "the module that ran it"), (None, "a fresh module"))):
        _export_case(c, modes[-1], None, None, 30 + n, attn=module, L=L,
                     after=f", after torch.func.grad, {which}", hint=hint)


def _export_case(c: Ctx, causal: bool, kind: str | None, backend: str | None, n: int, attn: Any = None,
                 L: int | None = None, after: str = "", hint: str = "", additive: bool = False) -> None:
    caps, dt = c.caps, c.precise()
    L, B, H = c.L if L is None else L, c.B, c.H
    module = _Exported(c.build(dtype=dt, backend=backend).eval() if attn is None else attn, causal, kind)
    q, k, v = c.inputs(L, L, dt, seed_offset=n)
    q2, k2, v2 = c.inputs(L, L, dt, seed_offset=n + 50)
    extra: tuple[Tensor, ...] = ()
    other: tuple[Tensor, ...] = ()
    if kind is not None:
        first, second = _mask_inputs(kind, B, H, L, c.device, dt if additive else None)
        extra, other = (first,), (second,)
    label = (f"causal={causal}, " + ("no mask input" if kind is None else
                                     f"an additive {kind} mask as an input" if additive else
                                     f"a {kind} mask as an input")
             + ("" if backend is None else f", backend={backend!r}") + after)

    def export() -> Any:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(module, (q, k, v, *extra))

    why = ("Capabilities.export is not declared" if not caps.export else
           f"{kind!r} is not in Capabilities.export_masks {caps.export_masks}"
           if kind is not None and kind not in caps.export_masks else
           f"{backend!r} is not in Capabilities.export_backends {caps.export_backends}"
           if backend is not None and backend not in caps.export_backends else None)
    if why is not None:
        c.expect_error(f"torch.export, {label}", UnsupportedFeatureError,
                       f"{why} (declare it, and this check compares the program, or refuse it)", export)
        return
    try:
        exported = export()
    except Exception as exc:  # noqa: BLE001
        c.fail(f"torch.export.export of {'a fresh module' if attn is None else 'the module'}, {label} (declared "
               f"in Capabilities.export{'' if kind is None else '_masks'}{'' if backend is None else '_backends'}) "
               f"raised {type(exc).__name__}: {exc}{hint}")
    try:   # what a deployment runs: the program saved and loaded again (once per causal mode and backend)
        if kind is None:
            buf = io.BytesIO()
            torch.export.save(exported, buf)
            buf.seek(0)
            exported = torch.export.load(buf)
        program = exported.module()
    except Exception as exc:  # noqa: BLE001
        c.fail(f"torch.export.save / load of the program, {label}, raised {type(exc).__name__}: {exc}{hint}")
    for which, args in (("the inputs it was exported with", (q, k, v, *extra)),
                        ("other inputs", (q2, k2, v2, *other))):
        want = c.call(module, f"eager after torch.export, {label}", *args[:3],
                      **({} if kind is None else {"x": args[3]}))
        if is_fake(want):
            c.fail(f"eager after torch.export, {label}: the output is a fake tensor (a cache filled "
                   "during the trace holds one; build caches inside attnkit.caching.outside_trace)")
        try:   # with gradients enabled, as a caller would (its parameters require them)
            got = program(*args)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"the exported program, {label}, on {which}, raised {type(exc).__name__}: {exc}{hint}")
        c.close(got.detach(), want, f"torch.export, {label}, on {which}", dtype=dt, against="eager")
    if additive:   # the program cannot raise at trace time: it must check its mask input when it runs
        bad = other[0].clone()
        bad[..., 0, 1] = float("nan")
        try:
            out = program(q, k, v, bad)
        except Exception:  # noqa: BLE001 - any clear refusal at run time (RuntimeError from an assertion)
            return
        c.fail(f"the exported program, {label}, ran an attn_mask holding NaN without raising (its output "
               f"{'holds NaN' if bool(out.isnan().any()) else 'is finite: the NaN was ignored'}); eager raises "
               "InvalidInputError: check the values in the program (torch._assert_async)")


#: Longest length a dynamic-length export declares when the implementation sets no limit.
DYNAMIC_MAX_LENGTH = 4096


def check_export_dynamic(cfg: ConformanceConfig) -> None:
    """``torch.export.export`` with the sequence length declared dynamic (one ``torch.export.Dim`` for the
    length of q, k, v; a fresh module, eval, the precise dtype, exported at the configured L). Each backend of
    ``Capabilities.export_dynamic`` that runs here is forced, in each causal mode (and with a key padding mask
    as an input of that length when ``export_masks`` holds ``key_padding``): the export must succeed and the
    program must give the eager output at lengths 1 (without a mask), 3, L + 5, the long length and 131 (those
    the instance's limits accept), so no value derived from the example's length stays in the program; on a
    backend with a backward, the gradients of q, k and v through the program equal eager's at the longest of
    those lengths (the last causal mode, no mask input). That program, one per backend, is the one saved and
    loaded (``torch.export.save`` / ``load``) before it runs; the others run as exported. Without a declaration
    the automatic choice is tried once in the last causal mode: it may fix the length (``torch.export`` then
    reports the dimension), but a program it does produce (saved and loaded) must be right at every length too.
    """
    c = Ctx("export_dynamic", cfg)
    caps = c.caps
    if not caps.export:
        c.skip("Capabilities.export is not declared")
    runnable, _ = c.backends()
    modes = c.causal_modes()
    if runnable == [None]:   # the factory takes no backend option: its one backend
        declared: list[str | None] = [None] if caps.export_dynamic else []
    else:
        declared = [b for b in runnable if b in caps.export_dynamic]
    n = 0
    for backend in declared:
        for causal in modes:   # (gradients in the last causal mode: a program's backward retraces its conditions)
            last = causal == modes[-1]
            _dynamic_case(c, causal, backend, False, n, required=True, gradients=last, roundtrip=last)
            n += 1
        if "key_padding" in caps.export_masks:
            _dynamic_case(c, modes[-1], backend, True, n, required=True)
            n += 1
    if not caps.export_dynamic:
        _dynamic_case(c, modes[-1], None, False, n, required=False, roundtrip=True)


def _dynamic_case(c: Ctx, causal: bool, backend: str | None, padded: bool, n: int, *, required: bool,
                  gradients: bool = False, roundtrip: bool = False) -> None:
    dt, L, B = c.precise(), c.L, c.B
    attn = c.build(dtype=dt, backend=backend)
    module = _Exported(attn, causal, "key_padding" if padded else None)
    limits = getattr(attn, "limits", None)
    top = DYNAMIC_MAX_LENGTH if limits is None or limits.max_length is None else limits.max_length
    lengths = [m for m in dict.fromkeys(((3,) if padded else (1, 3)) + (L + 5, c.cfg.long_length or 67, 131))
               if m <= top and (limits is None or limits.why_not(m, m) is None)]
    label = (f"causal={causal}, " + ("a key padding mask as an input" if padded else "no mask input")
             + (", backend='auto'" if backend is None else f", backend={backend!r}"))

    def args(m: int, seed: int) -> tuple[Tensor, ...]:
        q, k, v = c.inputs(m, m, dt, seed_offset=seed)
        return (q, k, v, padding_mask(B, m, c.device)) if padded else (q, k, v)

    length = torch.export.Dim("L", min=1, max=top)
    shapes = tuple({2: length} for _ in range(3)) + (({1: length},) if padded else ())
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exported = torch.export.export(module, args(L, n), dynamic_shapes=shapes)
    except Exception as exc:  # noqa: BLE001
        if not required:
            return
        c.fail(f"torch.export.export with a dynamic length (1..{top}), {label} (declared in "
               f"Capabilities.export_dynamic {c.caps.export_dynamic}) raised {type(exc).__name__}: "
               f"{str(exc).splitlines()[0] if str(exc) else ''}")
    try:   # a deployment's program: saved and loaded again (once per backend: loading a dynamic-length program
        if roundtrip:   # replays its symbolic shapes, 0.5-1 s for the sparse engine's, as long as its export)
            buf = io.BytesIO()
            torch.export.save(exported, buf)
            buf.seek(0)
            exported = torch.export.load(buf)
        program = exported.module()
    except Exception as exc:  # noqa: BLE001
        step = "torch.export.save / load" if roundtrip else "ExportedProgram.module()"
        c.fail(f"{step} of the dynamic-length program, {label}, raised {type(exc).__name__}: {exc}")
    for m in lengths:
        inputs = args(m, n + 60 + m)
        want = c.call(module, f"eager after torch.export, length {m}, {label}", *inputs[:3],
                      **({"x": inputs[3]} if padded else {}))
        try:
            got = program(*inputs)
        except Exception as exc:  # noqa: BLE001
            c.fail(f"the dynamic-length program (exported at L = {L}), {label}, at length {m} raised "
                   f"{type(exc).__name__}: {exc}")
        c.close(got.detach(), want, f"torch.export with a dynamic length (exported at L = {L}), {label}, at "
                f"length {m}", dtype=dt, against="eager")
    if gradients and c.trains(backend) and lengths:
        _dynamic_gradients(c, module, program, args, max(lengths), n, label)


def _dynamic_gradients(c: Ctx, module: torch.nn.Module, program: Any, args: Any, m: int, n: int,
                       label: str) -> None:
    """The gradients of q, k and v through the dynamic-length program at length ``m`` equal eager's (a
    program trained through, or differentiated for attributions, at a length other than the example's)."""
    dt, L = c.precise(), c.L
    inputs = args(m, n + 90 + m)
    leaves = tuple(x.detach().requires_grad_() for x in inputs[:3])
    weight = torch.randn(*inputs[0].shape[:3], inputs[2].shape[-1], generator=torch.Generator().manual_seed(m),
                         dtype=dt).to(c.device)
    case = f"gradients through the dynamic-length program (exported at L = {L}), {label}, at length {m}"
    grads = []
    for which, fn in (("eager", module), ("program", program)):
        try:
            with torch.enable_grad():
                out = fn(*leaves, *inputs[3:])
                grads.append(torch.autograd.grad((out * weight).sum(), leaves, allow_unused=True))
        except Exception as exc:  # noqa: BLE001
            first = str(exc).splitlines()[0] if str(exc) else ""
            c.fail(f"{case}: the {which} side raised {type(exc).__name__}: {first}")
    for name, got, want in zip("qkv", grads[1], grads[0], strict=True):
        if want is None and got is None:
            continue
        if got is None or want is None:
            c.fail(f"{case}: d{name} is {'None' if got is None else 'a tensor'} in the program, "
                   f"{'None' if want is None else 'a tensor'} in eager")
        c.close(got, want, f"{case}: d{name}", dtype=dt, what="gradient", against="eager")
