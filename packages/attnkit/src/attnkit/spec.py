"""Specs: what an implementation is, what it can do, and how to build it.

A spec is plain data. Its ``factory`` is an import path string
(``"pkg.module:Class"``), so listing and filtering never import kernels.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidInputError

#: the ``torch.func`` transforms a spec may declare (``Capabilities.func_transforms``): ``grad`` covers ``vjp``,
#: ``jacrev`` and ``hessian``'s reverse part; ``jvp`` covers ``jacfwd``
FUNC_TRANSFORMS = ("grad", "vmap", "jvp")
#: mask kinds that hold tensors, which may be inputs of a ``torch.export`` trace (``Capabilities.export_masks``)
TRACED_MASK_KINDS = ("key_padding", "tensor", "document", "function")
STREAMING_KINDS = ("exact", "segment")
#: mask kinds (see :mod:`attnkit.masks`); ``"union"`` marks a ``|`` composition
MASK_KINDS = ("causal", "key_padding", "tensor", "sliding_window", "document", "function", "union")


class FrozenMapping(Mapping):
    """A read-only dict that copies, deep-copies and pickles (``MappingProxyType`` does not)."""

    __slots__ = ("_d",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self, "_d", dict(data or {}))

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenMapping is read-only")

    def __reduce__(self):
        return (FrozenMapping, (dict(self._d),))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Mapping) and dict(self._d) == dict(other)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._d.items())))

    def __repr__(self) -> str:
        return repr(self._d)

KNOWN_DTYPES = ("float16", "bfloat16", "float32", "float64")
_NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Capabilities:
    """What an implementation can honour.

    Attributes:
        causal: accepts ``causal=True``.
        noncausal: accepts ``causal=False`` (False for causal-only recurrences).
        key_padding_mask: honours a ``(B, S)`` bool key padding mask.
        attn_mask: honours an arbitrary bool or additive ``attn_mask`` (and
            so, by materialising it, any mask object).
        mask_kinds: the mask kinds honoured (:data:`MASK_KINDS`); None derives
            them from ``causal``, ``key_padding_mask`` and ``attn_mask``
            (``attn_mask=True`` honours every kind). After construction it is
            always a tuple.
        positions: uses ``positions=`` (relative encodings, offsets, packed
            sequences); an implementation without it refuses explicit positions.
        state_detached: ``forward(..., return_state=True)`` returns a state
            detached from the graph (segment memory as in Transformer-XL);
            False: gradients flow through the state across calls.
        max_length: the longest L (and S) accepted with the default options
            (an instance may narrow it: :attr:`attnkit.Attention.limits`).
        length_multiple: L and S must be multiples of it (None: any length).
        cross: accepts L != S (cross-attention) when not causal.
        causal_cross: accepts ``causal=True`` with L != S (bottom-right aligned:
            query i sits at absolute position ``S - L + i``).
        streaming: ``"exact"`` (step outputs equal the causal forward),
            ``"segment"`` (segment memory with its own semantics) or None.
        varlen: accepts variable-length (packed) batches.
        dtypes: floating dtypes accepted, as names (``"float32"``).
        backends: backends in order of preference (``"torch"`` first-class).
        forward_only_backends: backends without a backward; skipped by
            automatic dispatch when a gradient is needed.
        time, memory: complexity, e.g. ``"O(L·M·D)"``.
        shared_qk: the mechanism ties keys to queries (Reformer's shared-QK: the key of
            a position is derived from its query): :class:`attnkit.MultiHeadAttention`
            builds no key projection and passes ``k = q``; self-attention only.
        queries_interact: an output row depends on other queries (landmarks,
            clusters or a top-u choice mix them), so a NaN query may spread: the
            conformance kit's ``nan_queries`` check is skipped with that reason.
        selection_sees_future: with ``causal=True`` no query attends a later key,
            but *which* earlier keys it attends is chosen from the content of the
            whole sequence (LSH chunks sorted by bucket, balanced top-w clusters),
            so a later token can change an earlier output, as in the papers: the
            kit's ``causality`` check is skipped with that reason (the plugin tests
            that no attended pair is in the future).
        context_parallel: runs causal attention over a sequence split along L
            across the ranks of a process group
            (:func:`attnkit.context_parallel.context_parallel`): the class
            implements ``_context_parallel``.
        func_transforms: the ``torch.func`` transforms (``"grad"``, ``"vmap"``,
            ``"jvp"``) its ``torch`` backend composes with; under them ``auto``
            runs that backend, and an undeclared transform is refused
            (:mod:`attnkit.transforms`; the kit's ``func_transforms`` check).
        export: it runs under :func:`torch.export.export` (non-strict, eval): the program gives the eager
            output for any inputs of the exported shapes; an implementation without it is refused while
            exporting (the kit's ``export`` check).
        export_backends: the backends whose computation an exported program can hold: ATen operators
            (``torch``, ``sdpa``: the program loads anywhere) or custom operators with a fake implementation
            (attnkit's ``numba`` kernels: loading the program needs the plugin imported). While exporting,
            ``auto`` picks the first of them in its usual order that runs on the device; a forced backend
            not among them is refused. None (the default): ``("torch",)`` with ``export``, else none.
        export_masks: the mask kinds (of :data:`TRACED_MASK_KINDS`, ``"key_padding"``, ``"tensor"``,
            ``"document"``, ``"function"``) whose tensors may be inputs of the exported program (a key
            padding mask passed to it); a mask of another kind built from its inputs is refused while
            exporting. Masks that hold no input (causal, windows, constants) need no declaration. None
            (the default) derives it: with ``export``, every kind of ``mask_kinds`` among them; without, none.
            After construction it is always a tuple.
        export_dynamic: the backends of ``export_backends`` whose programs keep a dynamic length: exported with
            the sequence length declared dynamic (``dynamic_shapes``, one ``torch.export.Dim`` for the length of
            q, k, v and of a key padding mask), the program gives the eager output at other lengths, in every
            causal mode. On the others the export fixes the length (``torch.export`` reports the dimension as
            specialised: export once per length, or pad to one length with a key padding mask). Default ``()``.
    """

    causal: bool = True
    noncausal: bool = True
    key_padding_mask: bool = True
    attn_mask: bool = False
    cross: bool = True
    causal_cross: bool = False
    streaming: str | None = None
    varlen: bool = False
    mask_kinds: tuple[str, ...] | None = None
    positions: bool = False
    state_detached: bool = False
    max_length: int | None = None
    length_multiple: int | None = None
    dtypes: tuple[str, ...] = ("float32", "float64")
    backends: tuple[str, ...] = ("torch",)
    forward_only_backends: tuple[str, ...] = ()
    time: str = ""
    memory: str = ""
    shared_qk: bool = False
    queries_interact: bool = False
    selection_sees_future: bool = False
    context_parallel: bool = False
    func_transforms: tuple[str, ...] = ()
    export: bool = False
    export_masks: tuple[str, ...] | None = None
    export_backends: tuple[str, ...] | None = None
    export_dynamic: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.streaming is not None and self.streaming not in STREAMING_KINDS:
            raise InvalidInputError(
                f"Capabilities.streaming must be one of {STREAMING_KINDS} or None, got {self.streaming!r}"
            )
        for d in self.dtypes:
            if d not in KNOWN_DTYPES:
                raise InvalidInputError(
                    f"Capabilities.dtypes must name floating dtypes from {KNOWN_DTYPES}, got {d!r}"
                )
        if not self.backends or "torch" not in self.backends:
            raise InvalidInputError(
                f"Capabilities.backends must include 'torch' (the readable path), got {self.backends!r}"
            )
        if not (self.causal or self.noncausal):
            raise InvalidInputError("Capabilities: at least one of causal / noncausal must be True")
        if self.mask_kinds is None:
            kinds = MASK_KINDS if self.attn_mask else tuple(
                k for k, on in (("causal", self.causal), ("key_padding", self.key_padding_mask)) if on)
        else:
            kinds = tuple(self.mask_kinds)
            unknown = [k for k in kinds if k not in MASK_KINDS]
            if unknown:
                raise InvalidInputError(f"Capabilities.mask_kinds: unknown kind(s) {unknown}; known: {MASK_KINDS}")
        object.__setattr__(self, "mask_kinds", kinds)
        unknown = [t for t in self.func_transforms if t not in FUNC_TRANSFORMS]
        if isinstance(self.func_transforms, str) or unknown:
            raise InvalidInputError(
                f"Capabilities.func_transforms must be a tuple of {FUNC_TRANSFORMS}, got {self.func_transforms!r}")
        object.__setattr__(self, "func_transforms", tuple(self.func_transforms))
        if not isinstance(self.export, bool):
            raise InvalidInputError(f"Capabilities.export must be a bool, got {self.export!r}")
        if self.export_masks is None:
            traced = tuple(k for k in kinds if k in TRACED_MASK_KINDS) if self.export else ()
        else:
            bad = [k for k in self.export_masks if k not in TRACED_MASK_KINDS or k not in kinds]
            if isinstance(self.export_masks, str) or bad or (self.export_masks and not self.export):
                raise InvalidInputError(
                    f"Capabilities.export_masks must be a tuple of the mask kinds among {TRACED_MASK_KINDS} that "
                    f"mask_kinds {kinds} holds, with export=True; got {self.export_masks!r} "
                    f"(export={self.export!r})")
            traced = tuple(self.export_masks)
        object.__setattr__(self, "export_masks", traced)
        if self.export_backends is None:
            eb: tuple[str, ...] = ("torch",) if self.export else ()
        else:
            eb = tuple(self.export_backends)
            if (isinstance(self.export_backends, str) or any(b not in self.backends for b in eb)
                    or (eb and not self.export)):
                raise InvalidInputError(
                    f"Capabilities.export_backends must be a tuple of its backends {self.backends} with "
                    f"export=True; got {self.export_backends!r} (export={self.export!r})")
        object.__setattr__(self, "export_backends", eb)
        if isinstance(self.export_dynamic, str) or any(b not in eb for b in self.export_dynamic):
            raise InvalidInputError(
                f"Capabilities.export_dynamic must be a tuple of backends among export_backends {eb}; got "
                f"{self.export_dynamic!r}")
        object.__setattr__(self, "export_dynamic", tuple(self.export_dynamic))
        for name in ("max_length", "length_multiple"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise InvalidInputError(f"Capabilities.{name} must be an int >= 1 or None, got {v!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Paper:
    """Where a mechanism comes from."""

    authors: str
    year: int
    title: str
    arxiv: str = ""

    def __str__(self) -> str:
        s = f"{self.authors} ({self.year}). {self.title}."
        return s + (f" arXiv:{self.arxiv}" if self.arxiv else "")


@dataclass(frozen=True)
class OptionSpec:
    """One constructor option: name, type (as text), default, help and constraints.

    ``build`` validates given values against it (:mod:`attnkit.options`): the
    type text (``int``, ``float``, ``bool``, ``str``, ``Literal[...]``, unions
    with ``None``), ``choices``, and the range ``minimum``/``maximum`` (with
    ``exclusive_minimum``/``exclusive_maximum``). Floats must be finite unless
    ``allow_nonfinite``. A factory class declares constraints as a class
    attribute ``option_constraints = {"num_features": {"minimum": 1},
    "dropout": {"minimum": 0, "maximum": 1, "exclusive_maximum": True}}``.
    """

    name: str
    type: str
    default: Any
    help: str = ""
    required: bool = False
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    allow_nonfinite: bool = False


@dataclass(frozen=True)
class AttentionSpec:
    """A registered implementation.

    Attributes:
        name: lower-case, ``-`` separated registry name.
        factory: ``"pkg.module:Class"`` import path, or the class itself
            (in-process registration).
        family: ``"core"``, ``"sparse"``, ``"kernelized"``, ``"lowrank"``,
            ``"memory"``, ``"adaptive"`` or a third party's own.
        summary: one line.
        capabilities: see :class:`Capabilities`.
        aliases: other names that select this spec.
        paper: the source.
        exact: equals softmax attention.
        approximation: what it approximates and how (when not exact).
        error_bound: maximal relative error of the output against exact
            softmax attention on the conformance kit's stated input
            distribution, with the default options; None when the mechanism
            is not an approximation of softmax attention.
        defaults: keyword arguments given to the factory before the user's.
        reference: ``"pkg.module:function"`` (or the function) computing the same
            mechanism with the same options and randomness the plain O(L·S)
            way: ``reference(attn, q, k, v, *, mask, positions) -> (B, H, L, E)``,
            where ``attn`` is the built module (its parameters and random
            features), ``mask`` an :class:`attnkit.masks.Mask` or None. The
            conformance kit compares every backend with it in float64. None for
            an exact spec means softmax attention
            (:func:`attnkit.reference.softmax_reference`).
        aux_losses: ``{name: default weight}`` of the auxiliary losses the
            module records during forward (:func:`attnkit.aux_losses`).
        options: explicit options schema; None derives it from the factory's
            signature and its docstring's ``Args:`` section.
        plugin, distribution, version: filled in by the registry.
    """

    name: str
    factory: str | type
    family: str
    summary: str
    capabilities: Capabilities = field(default_factory=Capabilities)
    aliases: tuple[str, ...] = ()
    paper: Paper | None = None
    exact: bool = False
    approximation: str = ""
    error_bound: float | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    options: tuple[OptionSpec, ...] | None = None
    reference: str | Callable[..., Any] | None = None
    aux_losses: Mapping[str, float] = field(default_factory=dict, hash=False)
    plugin: str = ""
    distribution: str = ""
    version: str = ""

    def __post_init__(self) -> None:
        _check_identity(self, "AttentionSpec", "sliding-window")
        if not isinstance(self.capabilities, Capabilities):
            raise InvalidInputError(
                f"AttentionSpec.capabilities must be a Capabilities, got {type(self.capabilities).__name__}"
            )
        if self.error_bound is not None and not self.error_bound > 0:
            raise InvalidInputError(f"AttentionSpec.error_bound must be > 0 or None, got {self.error_bound!r}")
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "defaults", FrozenMapping(self.defaults))
        for n, w in dict(self.aux_losses).items():
            if not isinstance(n, str) or not n or isinstance(w, bool) or not isinstance(w, (int, float)):
                raise InvalidInputError(
                    f"AttentionSpec.aux_losses must map loss names to float weights, got {n!r}: {w!r}")
        object.__setattr__(self, "aux_losses", FrozenMapping({n: float(w) for n, w in self.aux_losses.items()}))
        if self.reference is not None and isinstance(self.reference, str) and ":" not in self.reference:
            raise InvalidInputError(
                f"AttentionSpec.reference must be 'module.path:function', got {self.reference!r}")

    def __repr__(self) -> str:  # short: available() lists many; `attnkit describe` shows everything
        dist = f", distribution={self.distribution!r}" if self.distribution else ""
        return f"AttentionSpec({self.name!r}, family={self.family!r}{dist})"

    # -- derived ---------------------------------------------------------
    @property
    def qualified_name(self) -> str:
        return f"{self.family}/{self.name}"

    @property
    def factory_path(self) -> str:
        if isinstance(self.factory, str):
            return self.factory
        return f"{self.factory.__module__}:{self.factory.__qualname__}"

    def load_factory(self) -> Callable[..., Any]:
        """Import and return the factory (imports the mechanism's module)."""
        if not isinstance(self.factory, str):
            return self.factory
        module_name, _, attr = self.factory.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    @property
    def reference_path(self) -> str:
        """The reference's import path ('' when none is declared and the spec is not exact)."""
        ref = self.reference
        if ref is None:
            return "attnkit.reference:softmax_reference" if self.exact else ""
        if isinstance(ref, str):
            return ref
        return f"{ref.__module__}:{ref.__qualname__}"

    def load_reference(self) -> Callable[..., Any] | None:
        """Import and return the reference function (softmax's for an exact spec without one), or None."""
        ref = self.reference
        if ref is None:
            if not self.exact:
                return None
            ref = "attnkit.reference:softmax_reference"
        if not isinstance(ref, str):
            return ref
        module_name, _, attr = ref.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    def resolved_options(self) -> tuple[OptionSpec, ...]:
        """The options schema: explicit, or derived from the factory."""
        if self.options is not None:
            return self.options
        opts = derive_options(self.load_factory())
        return tuple(
            dataclasses.replace(o, default=self.defaults[o.name], required=False)
            if o.name in self.defaults else o
            for o in opts
        )

    def as_dict(self, *, with_options: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "qualified_name": self.qualified_name,
            "aliases": list(self.aliases),
            "family": self.family,
            "summary": self.summary,
            "exact": self.exact,
            "approximation": self.approximation,
            "error_bound": self.error_bound,
            "paper": dataclasses.asdict(self.paper) if self.paper else None,
            "factory": self.factory_path,
            "defaults": _jsonable(dict(self.defaults)),
            "reference": self.reference_path,
            "aux_losses": dict(self.aux_losses),
            "capabilities": self.capabilities.as_dict(),
            "plugin": self.plugin,
            "distribution": self.distribution,
            "version": self.version,
        }
        if with_options:
            d["options"] = [
                {**dataclasses.asdict(o), "default": _jsonable(o.default)} for o in self.resolved_options()
            ]
        return d


def _check_identity(spec: Any, kind: str, example: str) -> None:
    """Validate the name, aliases, family and factory shared by attention and block specs."""
    for what, value in [("name", spec.name)] + [("aliases", a) for a in spec.aliases]:
        if not isinstance(value, str) or not _NAME_RE.match(value):
            raise InvalidInputError(
                f"{kind}.{what} must be lower-case words joined by '-' (e.g. {example!r}), got {value!r}")
    if not isinstance(spec.family, str) or not _NAME_RE.match(spec.family):
        raise InvalidInputError(f"{kind}.family must be a lower-case name (e.g. 'sparse'), got {spec.family!r}")
    if isinstance(spec.factory, str):
        if ":" not in spec.factory:
            raise InvalidInputError(f"{kind}.factory must be 'module.path:ClassName', got {spec.factory!r}")
    elif not callable(spec.factory):
        raise InvalidInputError(
            f"{kind}.factory must be an import path string or a class, got {type(spec.factory).__name__}")


def _jsonable(x: Any) -> Any:
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return [_jsonable(i) for i in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return repr(x)


_BASE_OPTION_HELP = {
    "num_heads": "number of heads H (needed by mechanisms with per-head parameters or state)",
    "head_dim": "head dimension D (needed by mechanisms with parameters or features drawn for D)",
    "scale": "softmax temperature; None means 1/sqrt(D)",
    "backend": "'auto' picks the fastest backend for the tensors' device; or force one by name",
}


#: constraints of the options every implementation shares (Attention.__init__)
_BASE_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "num_heads": {"minimum": 1},
    "head_dim": {"minimum": 1},
    "scale": {"minimum": 0, "exclusive_minimum": True},
    "dropout": {"minimum": 0, "maximum": 1, "exclusive_maximum": True},
}


def _docstring_args(obj: Any) -> dict[str, str]:
    """Parse a Google-style ``Args:`` section of the class or __init__ docstring."""
    helps: dict[str, str] = {}
    for doc in (inspect.getdoc(obj) or "", inspect.getdoc(getattr(obj, "__init__", None)) or ""):
        lines = doc.splitlines()
        in_args = False
        current = None
        indent = None
        for line in lines:
            stripped = line.strip()
            if stripped in ("Args:", "Arguments:", "Parameters:"):
                in_args, current, indent = True, None, None
                continue
            if not in_args:
                continue
            if stripped and not line.startswith(" ") and stripped.endswith(":"):
                in_args = False  # next section
                continue
            if not stripped:
                continue
            lead = len(line) - len(line.lstrip())
            m = re.match(r"^(\w+)(?:\s*\(([^)]*)\))?\s*:\s*(.*)$", stripped)
            if m and (indent is None or lead <= indent):
                indent = lead
                current = m.group(1)
                helps[current] = m.group(3).strip()
            elif current is not None:
                helps[current] = (helps[current] + " " + stripped).strip()
    return helps


def derive_options(factory: Any) -> tuple[OptionSpec, ...]:
    """Options from a factory's constructor signature and ``Args:`` docstring.

    The type text is the annotation as written (``"int | None"``, ``"Optional[int]"``,
    ``"Literal['elu', 'relu']"``; a class by its name), or the default's type when
    unannotated. Ranges and choices come from the class attribute
    ``option_constraints`` (merged along the MRO, a subclass's entry winning; keys
    :data:`CONSTRAINT_KEYS`), over the base options' own (``num_heads``,
    ``head_dim`` >= 1, ``scale`` > 0, ``dropout`` in [0, 1))::

        class MyAttention(attnkit.Attention):
            option_constraints = {
                "num_features": {"minimum": 1},
                "dropout": {"minimum": 0, "maximum": 1, "exclusive_maximum": True},
                "feature_map": {"choices": ("elu", "relu")},
                "temperature": {"minimum": 0, "exclusive_minimum": True, "allow_nonfinite": True},
            }

    Raises:
        InvalidInputError: an ``option_constraints`` entry with an unknown key or a
            non-numeric bound, or (for a constructor without ``**kwargs``) naming an
            option the constructor does not take.
    """
    target = factory.__init__ if inspect.isclass(factory) else factory
    constraints = dict(_BASE_CONSTRAINTS)
    for klass in reversed(getattr(factory, "__mro__", ())):
        constraints.update(getattr(klass, "__dict__", {}).get("option_constraints", {}) or {})
    # Derived once per factory: reading a signature and docstring cost ~0.3 ms, paid by every build().
    # The key changes when the constructor or any option_constraints along the MRO does.
    key = (id(target), repr(constraints))
    try:
        hit = _DERIVED.get(factory)
    except TypeError:  # not hashable or not weak-referenceable: no cache
        hit = None
    if hit is not None and hit[0] == key:
        return hit[1]
    opts = _derive_options(factory, target, constraints)
    try:
        _DERIVED[factory] = (key, opts)
    except TypeError:
        pass
    return opts


#: factory -> (key, options) of :func:`derive_options`; weak, so classes defined in tests can go.
_DERIVED: weakref.WeakKeyDictionary[Any, tuple[tuple[int, str], tuple[OptionSpec, ...]]] = weakref.WeakKeyDictionary()


def _derive_options(factory: Any, target: Any, constraints: dict[str, Any]) -> tuple[OptionSpec, ...]:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return ()
    helps = _docstring_args(factory)
    opts = []
    for p in sig.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        ann = p.annotation
        if ann is inspect.Parameter.empty:
            type_text = type(p.default).__name__ if p.default not in (inspect.Parameter.empty, None) else "any"
        elif isinstance(ann, str):
            type_text = ann
        else:
            # a class by its name; typing forms (Optional[int], Literal['a', 'b']) by their text, arguments kept
            type_text = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
        required = p.default is inspect.Parameter.empty
        extra = _constraint_fields(factory, p.name, constraints.get(p.name, {}))
        opts.append(OptionSpec(
            name=p.name,
            type=type_text,
            default=None if required else p.default,
            help=helps.get(p.name) or _BASE_OPTION_HELP.get(p.name, ""),
            required=required,
            **extra,
        ))
    own = getattr(factory, "__dict__", {}).get("option_constraints") or {}
    takes_extra = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    stray = sorted(set(own) - {o.name for o in opts})
    if stray and not takes_extra:
        raise InvalidInputError(
            f"{getattr(factory, '__qualname__', factory)}.option_constraints names {stray}, which the "
            f"constructor does not take; its options: {[o.name for o in opts]}")
    return tuple(opts)


#: the keys an ``option_constraints`` entry may hold (fields of :class:`OptionSpec`)
CONSTRAINT_KEYS = ("choices", "minimum", "maximum", "exclusive_minimum", "exclusive_maximum", "allow_nonfinite")


def _constraint_fields(factory: Any, name: str, raw: Any) -> dict[str, Any]:
    """One ``option_constraints`` entry checked and turned into :class:`OptionSpec` fields."""
    where = f"{getattr(factory, '__qualname__', factory)}.option_constraints[{name!r}]"
    if not isinstance(raw, Mapping):
        raise InvalidInputError(f"{where}: expected a dict such as {{'minimum': 1}}, got {raw!r}")
    bad = sorted(set(raw) - set(CONSTRAINT_KEYS))
    if bad:
        raise InvalidInputError(f"{where}: unknown key(s) {bad}; valid keys: {list(CONSTRAINT_KEYS)}")
    out = dict(raw)
    for key in ("minimum", "maximum"):
        v = out.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise InvalidInputError(f"{where}: {key} must be a number or None, got {v!r}")
    if out.get("choices") is not None:
        if isinstance(out["choices"], str):
            raise InvalidInputError(f"{where}: choices must be a tuple of values, got the string {out['choices']!r}")
        out["choices"] = tuple(out["choices"])
    return out


@dataclass(frozen=True, repr=False)
class BlockSpec:
    """A registered block-level mechanism: a module ``(B, L, dim) -> (B, L, dim)``.

    Built with :func:`attnkit.build_block` as ``factory(dim=..., num_heads=...,
    attention=..., **defaults, **options)``.

    Attributes:
        name: lower-case, ``-`` separated registry name.
        factory: ``"pkg.module:Class"`` (an :class:`attnkit.Block` subclass) or the class.
        family, summary, aliases, paper: as for :class:`AttentionSpec`.
        defaults: keyword arguments given to the factory before the user's.
        options: explicit options schema; None derives it from the factory.
        streaming: ``"exact"``, ``"segment"`` or None (whether it steps).
        causal: the block accepts ``causal=True`` (every block accepts ``causal=False``).
        aux_losses: ``{name: default weight}`` of the losses the block records.
        plugin, distribution, version: filled in by the registry.
    """

    name: str
    factory: str | type
    family: str
    summary: str
    aliases: tuple[str, ...] = ()
    paper: Paper | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    options: tuple[OptionSpec, ...] | None = None
    streaming: str | None = None
    aux_losses: Mapping[str, float] = field(default_factory=dict, hash=False)
    plugin: str = ""
    distribution: str = ""
    version: str = ""
    causal: bool = True

    def __post_init__(self) -> None:
        _check_identity(self, "BlockSpec", "pre-norm")
        if not isinstance(self.causal, bool):
            raise InvalidInputError(f"BlockSpec.causal must be a bool, got {self.causal!r}")
        if self.streaming is not None and self.streaming not in STREAMING_KINDS:
            raise InvalidInputError(
                f"BlockSpec.streaming must be one of {STREAMING_KINDS} or None, got {self.streaming!r}")
        object.__setattr__(self, "aliases", tuple(self.aliases))
        object.__setattr__(self, "defaults", FrozenMapping(self.defaults))
        object.__setattr__(self, "aux_losses", FrozenMapping({n: float(w) for n, w in self.aux_losses.items()}))

    def __repr__(self) -> str:
        dist = f", distribution={self.distribution!r}" if self.distribution else ""
        return f"BlockSpec({self.name!r}, family={self.family!r}{dist})"

    @property
    def qualified_name(self) -> str:
        return f"{self.family}/{self.name}"

    factory_path = AttentionSpec.factory_path
    load_factory = AttentionSpec.load_factory
    resolved_options = AttentionSpec.resolved_options

    def as_dict(self, *, with_options: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name, "qualified_name": self.qualified_name, "aliases": list(self.aliases),
            "family": self.family, "summary": self.summary, "factory": self.factory_path,
            "paper": dataclasses.asdict(self.paper) if self.paper else None,
            "defaults": _jsonable(dict(self.defaults)), "streaming": self.streaming, "causal": self.causal,
            "aux_losses": dict(self.aux_losses), "plugin": self.plugin, "distribution": self.distribution,
            "version": self.version,
        }
        if with_options:
            d["options"] = [
                {**dataclasses.asdict(o), "default": _jsonable(o.default)} for o in self.resolved_options()
            ]
        return d
