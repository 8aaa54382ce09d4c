"""Measured backend choice: ``attnkit tune`` times backends, ``backend="auto"`` uses the winners.

:func:`tune` times every backend an implementation offers that can run here
(forward under ``no_grad`` and forward+backward, causal and non-causal, at a
few lengths) and stores the medians and the winners in a JSON cache file
(:func:`cache_path`). :func:`tuned_backend` is the cheap lookup the core makes
when it resolves ``backend="auto"``: the winner measured at the nearest length
(log scale) for the same device type, dtype and gradient need, or None, in
which case the core keeps its static choice (the first offered backend that
can run on the tensors' device).

Measurements are keyed by machine (architecture, CPU model, CPU count; never
the hostname) and torch version, and each implementation's by the version of
the distribution that provides it: a cache from another machine, another torch
or another plugin version is ignored, and a corrupt file is ignored with one
warning. :func:`generation` changes whenever the cache changes (written in this
process, or noticed on disk at most once a second) so that modules drop the
backends they cached.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import backends as _backends
from .aux import clear_aux_losses
from .errors import InvalidInputError, UsageError

__all__ = [
    "tune", "tuned_backend", "generation", "clear", "cache_path", "load", "describe_lines", "fingerprint",
    "configure_tune", "run_tune", "ENV_CACHE_DIR", "FORMAT",
]

#: environment variable naming the cache directory (wins over the platform default)
ENV_CACHE_DIR = "ATTNKIT_CACHE_DIR"
#: version of the cache file's layout; a file of another format is ignored (and replaced by ``tune``)
FORMAT = 1
CACHE_FILE = "tuning.json"
DEFAULT_LENGTHS = (256, 1024, 4096)
MAX_LENGTH = 2 ** 20
MAX_REPEATS = 100
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
#: seconds between two looks at the cache file's modification (other processes' writes)
RESTAT_SECONDS = 1.0


# ------------------------------------------------------------------ where and for whom
@functools.lru_cache(maxsize=1)
def _default_dir() -> Path:
    try:
        import platformdirs
    except ImportError:
        return Path("~/.cache/attnkit").expanduser()
    return Path(platformdirs.user_cache_dir("attnkit"))


def cache_path() -> Path:
    """The cache file: ``$ATTNKIT_CACHE_DIR/tuning.json``, else in the user cache directory.

    The user cache directory is ``platformdirs.user_cache_dir("attnkit")`` when
    platformdirs is installed, else ``~/.cache/attnkit``.
    """
    env = os.environ.get(ENV_CACHE_DIR, "").strip()
    base = Path(env).expanduser() if env else _default_dir()
    return base / CACHE_FILE


@functools.lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip().lower() in ("model name", "hardware", "cpu model", "processor") \
                        and value.strip() and not value.strip().isdigit():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or "unknown"


def fingerprint() -> dict[str, Any]:
    """What a measurement is valid for: ``{"arch", "cpu", "cpus", "torch"}`` (no hostname)."""
    return {"arch": platform.machine() or "unknown", "cpu": _cpu_model(), "cpus": os.cpu_count() or 0,
            "torch": torch.__version__}


def _machine_key(fp: dict[str, Any]) -> str:
    return f"{fp['arch']} | {fp['cpu']} | {fp['cpus']} cpus | torch {fp['torch']}"


def _spec_key(spec: Any) -> str:
    return f"{spec.distribution or spec.plugin or 'local'}:{spec.name}"


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, torch.dtype):
        return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return str(dtype)


@functools.lru_cache(maxsize=16)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_name(device: torch.device) -> str:
    """The accelerator's model for CUDA devices ('' for the CPU: the machine key names it)."""
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_name(index)


# ------------------------------------------------------------------ the in-memory copy
class _State:
    def __init__(self) -> None:
        self.setting: str | None = None  # the ATTNKIT_CACHE_DIR value path was computed from
        self.path: Path | None = None
        self.sig: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) of what was read; None: no file
        self.checked = -math.inf
        self.data: dict[str, Any] | None = None  # None: not read yet
        self.index: dict[str, Any] | None = None  # this machine's winners, built on first lookup
        self.index_key: str | None = None
        self.gen = 0
        self.warned: set[tuple[str, Any]] = set()


_LOCK = threading.RLock()
_S = _State()


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _forget(bump: bool = True) -> None:
    _S.data = None
    _S.index = None
    _S.index_key = None
    if bump:
        _S.gen += 1


def _refresh() -> None:
    """Follow a change of ATTNKIT_CACHE_DIR at once, and of the file at most once a second."""
    setting = os.environ.get(ENV_CACHE_DIR, "")
    now = time.monotonic()
    with _LOCK:
        if _S.path is None or setting != _S.setting:
            path = cache_path()
            _S.setting = setting
            if path != _S.path:
                _S.path = path
                _S.sig = _stat(path)
                _S.checked = now
                _forget()
                return
        if now - _S.checked >= RESTAT_SECONDS:
            _S.checked = now
            sig = _stat(_S.path)
            if sig != _S.sig:
                _S.sig = sig
                _forget()


def generation() -> int:
    """A counter that changes whenever the cache changes.

    It moves when this process writes or clears the cache, when
    ``ATTNKIT_CACHE_DIR`` changes, and when another process's write is noticed
    (the file is looked at no more than once a second). The core keys its
    per-module backend caches on it.
    """
    _refresh()
    return _S.gen


def _warn_corrupt(path: Path, reason: str) -> None:
    key = (str(path), _S.sig)
    if key in _S.warned:
        return
    _S.warned.add(key)
    warnings.warn(f"attnkit: ignoring the tuning cache {path}: {reason}; run `attnkit tune` to measure again "
                  "or `attnkit tune --clear` to remove it", RuntimeWarning, stacklevel=3)


def _read(path: Path) -> tuple[dict[str, Any], str | None]:
    """``(data, None)``, or ``({}, reason)`` for a file that cannot be used; no file is ``({}, None)``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"cannot read it ({exc})"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return {}, f"it is not valid JSON ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("machines"), dict):
        return {}, "it is not an attnkit tuning cache"
    if data.get("format") != FORMAT:
        return {}, f"it has format {data.get('format')!r}, this attnkit reads format {FORMAT}"
    return data, None


def _data() -> dict[str, Any]:
    with _LOCK:
        if _S.data is None:
            assert _S.path is not None
            data, problem = _read(_S.path)
            if problem is not None:
                _warn_corrupt(_S.path, problem)
            _S.data = data
        return _S.data


def load() -> dict[str, Any]:
    """A copy of the whole cache (every machine's entries); ``{}`` without a usable file."""
    _refresh()
    return copy.deepcopy(_data())


def _build_index(data: dict[str, Any], key: str) -> dict[str, Any]:
    """``{spec_key: (version, {(device, device_name, dtype, grad): [(length, causal, winner)]})}``."""
    entry = data.get("machines", {}).get(key)
    if not isinstance(entry, dict) or entry.get("torch") != torch.__version__:
        return {}
    index: dict[str, Any] = {}
    for skey, sentry in entry.get("specs", {}).items():
        rows: dict[tuple[str, str, str, bool], list[tuple[int, bool, str]]] = {}
        for r in sentry.get("results", ()):
            winner = r.get("winner")
            length = r.get("length")
            if not isinstance(winner, str) or not isinstance(length, int) or length < 1:
                continue
            group = (str(r["device"]), str(r.get("device_name", "")), str(r["dtype"]), bool(r["grad"]))
            rows.setdefault(group, []).append((length, bool(r["causal"]), winner))
        index[skey] = (str(sentry.get("version", "")), rows)
    return index


def _index() -> dict[str, Any]:
    key = _machine_key(fingerprint())
    with _LOCK:
        if _S.index is None or _S.index_key != key:
            data = _data()
            try:
                _S.index = _build_index(data, key) if data else {}
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                assert _S.path is not None
                _warn_corrupt(_S.path, f"malformed entry ({type(exc).__name__}: {exc})")
                _S.index = {}
            _S.index_key = key
        return _S.index


def tuned_backend(spec: Any, *, device: torch.device | str, dtype: torch.dtype | str, needs_grad: bool,
                  length: int, causal: bool | None = None) -> str | None:
    """The backend measured fastest here for ``spec``, or None (then the static choice applies).

    Looks up the measurement at the nearest measured length (log scale) for the
    same device type, dtype and gradient need, preferring ``causal``'s mode
    (``causal=True`` results when ``causal`` is None, the other mode when that
    one was not measured). None without a cache, for a cache from another
    machine, torch version or version of the spec's distribution, for a
    corrupt cache (warned about once), and for a forward-only winner when a
    gradient is needed. Never raises for a bad cache.
    """
    if spec is None:
        return None
    _refresh()
    found = _index().get(_spec_key(spec))
    if found is None:
        return None
    version, groups = found
    if version != (spec.version or ""):
        return None
    dev = torch.device(device)
    rows = groups.get((dev.type, _device_name(dev), _dtype_name(dtype), bool(needs_grad)))
    if not rows:
        return None
    want = True if causal is None else bool(causal)
    pick = [r for r in rows if r[1] == want] or [r for r in rows if r[1]] or rows
    target = math.log(max(int(length), 1))
    _, _, winner = min(pick, key=lambda r: (abs(math.log(r[0]) - target), r[0]))
    caps = spec.capabilities
    if winner not in caps.backends or (needs_grad and winner in caps.forward_only_backends):
        return None
    return winner


# ------------------------------------------------------------------ writing
def _write(data: dict[str, Any]) -> Path:
    """Write the whole cache atomically (replace, never a half-written file) and bump the generation."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tuning-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is as readable as any other cache file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with _LOCK:
        _S.setting = os.environ.get(ENV_CACHE_DIR, "")
        _S.path = path
        _S.sig = _stat(path)
        _S.checked = time.monotonic()
        _forget()
        _S.data = copy.deepcopy(data)
    return path


def clear() -> bool:
    """Remove the cache file; True when there was one. ``backend="auto"`` goes back to the static choice."""
    path = cache_path()
    try:
        path.unlink()
        removed = True
    except FileNotFoundError:
        removed = False
    with _LOCK:
        _S.setting = os.environ.get(ENV_CACHE_DIR, "")
        _S.path = path
        _S.sig = None
        _S.checked = time.monotonic()
        _forget()
    return removed


# ------------------------------------------------------------------ measuring
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    fn()  # warm-up: first-call costs (compilation, allocation, kernel caches) are not the steady state
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


def _check_tune_args(lengths: Any, repeats: Any, batch: Any, heads: Any, head_dim: Any) -> tuple[int, ...]:
    if isinstance(lengths, int):
        lengths = (lengths,)
    try:
        out = tuple(lengths)
    except TypeError:
        raise InvalidInputError(f"tune: lengths must be a sequence of ints, got {lengths!r}") from None
    if not out or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LENGTH for n in out):
        raise InvalidInputError(f"tune: lengths must be ints in 1..{MAX_LENGTH}, got {lengths!r}")
    for name, value, high in (("repeats", repeats, MAX_REPEATS), ("batch", batch, None), ("heads", heads, None),
                              ("head_dim", head_dim, None)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (high and value > high):
            rng = f"1..{high}" if high else ">= 1"
            raise InvalidInputError(f"tune: {name} must be an int in {rng}, got {value!r}")
    return tuple(sorted(set(out)))


def _fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


def _result_line(r: dict[str, Any]) -> str:
    mode = "fwd+bwd" if r["grad"] else "forward"
    kind = "causal" if r["causal"] else "non-causal"
    dev = r["device"] + (f" ({r['device_name']})" if r.get("device_name") else "")
    times = "  ".join(f"{b} {_fmt_seconds(s)}" for b, s in sorted(r["seconds"].items(), key=lambda x: x[1]))
    failed = "  ".join(f"{b} failed" for b in r.get("failed", {}))
    figures = "  ".join(x for x in (times, failed) if x) or "-"
    win = f"-> {r['winner']}" if r.get("winner") else "-> (none ran)"
    return f"{dev} {r['dtype']} {mode:7} {kind:10} L={r['length']:<7} {figures}  {win}"


def _tune_spec(reg: Any, spec: Any, *, lengths: tuple[int, ...], repeats: int, device: torch.device,
               dtype: torch.dtype, batch: int, heads: int, head_dim: int,
               say: Callable[[str], None]) -> dict[str, Any]:
    caps = spec.capabilities
    out: dict[str, Any] = {"name": spec.name, "distribution": spec.distribution or spec.plugin,
                           "version": spec.version or "", "results": [], "skipped": []}
    dname = _dtype_name(dtype)
    if dname not in caps.dtypes:
        reason = f"it takes dtypes {', '.join(caps.dtypes)}, not {dname}"
        out["skipped"].append({"length": None, "reason": reason})
        say(f"{spec.name}: skipped: {reason}")
        return out
    # what backend="auto" could pick (forced=False): no triton interpreter timings on CPU
    runnable = [b for b in caps.backends if _backends.why_unavailable(b, device) is None]
    unavailable = {b: _backends.why_unavailable(b, device) for b in caps.backends if b not in runnable}
    for b, why in unavailable.items():
        say(f"{spec.name}: backend {b} not measured: {why}")
    out["unavailable"] = unavailable
    qualified = f"{out['distribution']}:{spec.name}" if out["distribution"] else spec.name
    modules: dict[str, Any] = {}
    build_failed: dict[str, str] = {}
    for b in runnable:
        try:
            attn = reg.build_with_hints(qualified, {"num_heads": heads, "head_dim": head_dim}, backend=b)
            modules[b] = attn.to(device=device, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - one backend failing to build is a result, not fatal
            build_failed[b] = _error_text(exc)
            say(f"{spec.name}: backend {b} failed to build: {build_failed[b]}")
    modes = [c for c, on in ((False, caps.noncausal), (True, caps.causal)) if on]
    fp = fingerprint()
    dev_name = _device_name(device)
    gen = torch.Generator().manual_seed(0)
    for length in lengths:
        probe = next(iter(modules.values()), None)
        why = probe.limits.why_not(length, length) if probe is not None else None
        if why is not None:
            out["skipped"].append({"length": length, "reason": why})
            say(f"{spec.name}: L={length} skipped: its limits refuse it ({why})")
            continue
        shape = (batch, heads, length, head_dim)
        base = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
        for grad in (False, True):
            for causal in modes:
                seconds: dict[str, float] = {}
                failed = dict(build_failed)
                for b, attn in modules.items():
                    if grad and b in caps.forward_only_backends:
                        continue
                    try:
                        seconds[b] = _time_one(attn, base, causal=causal, grad=grad, repeats=repeats,
                                               device=device)
                    except Exception as exc:  # noqa: BLE001 - a backend that raises is recorded as failed
                        failed[b] = _error_text(exc)
                winner = min(seconds, key=seconds.__getitem__) if seconds else None
                r = {"device": device.type, "device_name": dev_name, "dtype": dname, "grad": grad,
                     "causal": causal, "length": length, "seconds": seconds, "failed": failed, "winner": winner,
                     "shape": {"batch": batch, "heads": heads, "head_dim": head_dim}, "repeats": repeats,
                     "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": fp["torch"]}
                out["results"].append(r)
                say(f"{spec.name}: {_result_line(r)}")
                for b, err in failed.items():
                    if b not in build_failed:
                        say(f"{spec.name}:   {b} failed: {err}")
        del base
    return out


def _time_one(attn: Any, base: Sequence[torch.Tensor], *, causal: bool, grad: bool, repeats: int,
              device: torch.device) -> float:
    if not grad:
        attn.eval()

        def fwd() -> None:
            with torch.no_grad():
                attn(*base, causal=causal)

        return _median_seconds(fwd, repeats, device)
    attn.train()
    q, k, v = (t.detach().clone().requires_grad_(True) for t in base)

    def fwd_bwd() -> None:
        q.grad = k.grad = v.grad = None
        attn.zero_grad(set_to_none=True)
        out = attn(q, k, v, causal=causal)
        out.sum().backward()
        clear_aux_losses(attn)   # uncollected, each call's loss would keep its graph alive

    try:
        return _median_seconds(fwd_bwd, repeats, device)
    finally:
        attn.zero_grad(set_to_none=True)
        attn.eval()


def _merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """One spec's entry: new results replace old ones of the same case; another version's are dropped."""
    if not isinstance(old, dict) or old.get("version") != new["version"]:
        return new

    def case(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r.get("device"), r.get("device_name", ""), r.get("dtype"), r.get("grad"), r.get("causal"),
                r.get("length"))

    fresh = {case(r) for r in new["results"]}
    kept = [r for r in old.get("results", ()) if isinstance(r, dict) and case(r) not in fresh]
    merged = dict(new)
    merged["results"] = sorted(kept + new["results"], key=lambda r: tuple(str(x) for x in case(r)))
    return merged


def tune(names: Iterable[str] | str | None = None, *, lengths: Sequence[int] = DEFAULT_LENGTHS, repeats: int = 3,
         device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32, batch: int = 1,
         heads: int = 4, head_dim: int = 32, progress: Callable[[str], Any] | None = print,
         registry: Any = None) -> dict[str, Any]:
    """Time each backend of each named mechanism here and store the winners for ``backend="auto"``.

    For every spec (default: every registered one), every offered backend
    that can run on ``device`` (forward-only ones only for the forward
    measurement), every length the instance's limits accept, with and without
    gradients and in each of the causal and non-causal modes the spec offers,
    it times ``repeats`` calls after one warm-up call and keeps the median. A
    backend that raises is recorded as failed; a length the limits refuse is
    skipped with the reason. The results are merged into the cache file
    (:func:`cache_path`) under this machine's key.

    Args:
        names: registered names (default: all).
        lengths: sequence lengths L = S to measure, each in 1..2**20.
        repeats: timed calls per case, 1..100 (their median is kept).
        device: where to measure (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        dtype: ``torch.float32`` or a name (``"bfloat16"``).
        batch, heads, head_dim: the input shape ``(batch, heads, L, head_dim)``.
        progress: called with one line per measurement (None: quiet).
        registry: the registry to take specs from (default: the process-wide one).

    Returns:
        ``{"path", "machine", "key", "specs": {"dist:name": {"name", "distribution",
        "version", "results": [...], "skipped": [...], "unavailable": {...}}}}``;
        each result holds ``device``, ``dtype``, ``grad``, ``causal``, ``length``,
        ``seconds`` (median per backend), ``failed`` (backend: error) and ``winner``.

    Raises:
        InvalidInputError: bad lengths, repeats, shape, dtype or device.
        UnknownAttentionError, AmbiguousNameError: a name that does not resolve.
    """
    from .registry import default_registry

    lengths = _check_tune_args(lengths, repeats, batch, heads, head_dim)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"tune: device must be a torch device such as 'cpu' or 'cuda', got {device!r}") \
            from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"tune: device {device!r} requested but CUDA is not available here")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InvalidInputError(f"tune: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype not in _DTYPE_NAMES:
        raise InvalidInputError(f"tune: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    reg = registry or default_registry()
    if isinstance(names, str):
        names = [names]
    specs = [reg.resolve(n) for n in names] if names else list(reg.specs())
    say = progress or (lambda _line: None)
    fp = fingerprint()
    key = _machine_key(fp)
    measured: dict[str, Any] = {}
    for spec in specs:
        if _spec_key(spec) in measured:
            continue
        measured[_spec_key(spec)] = _tune_spec(reg, spec, lengths=lengths, repeats=repeats, device=dev,
                                               dtype=dtype, batch=batch, heads=heads, head_dim=head_dim, say=say)
    _refresh()
    data = copy.deepcopy(_data()) or {"format": FORMAT, "machines": {}}
    entry = data["machines"].get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("specs"), dict):
        entry = {"machine": {k: fp[k] for k in ("arch", "cpu", "cpus")}, "torch": fp["torch"], "specs": {}}
    for skey, sentry in measured.items():
        entry["specs"][skey] = _merge(entry["specs"].get(skey), sentry)
    entry["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    data["machines"][key] = entry
    data["format"] = FORMAT
    path = _write(data)
    say(f"wrote {path}")
    return {"path": str(path), "machine": fp, "key": key, "specs": measured}


# ------------------------------------------------------------------ showing
def describe_lines(spec: Any) -> list[str]:
    """Human-readable figures measured here for ``spec`` (an :class:`AttentionSpec` or a name).

    ``attnkit describe`` prints them under a heading: the cache file, then one
    line per measured case (device, dtype, forward or fwd+bwd, causal mode,
    length, the median per backend, the winner) and the lengths skipped; a
    single line when nothing usable was measured on this machine.
    """
    if isinstance(spec, str):
        from .registry import default_registry

        spec = default_registry().resolve(spec)
    _refresh()
    data = _data()
    entry = data.get("machines", {}).get(_machine_key(fingerprint())) if data else None
    sentry = entry.get("specs", {}).get(_spec_key(spec)) if isinstance(entry, dict) else None
    if not isinstance(sentry, dict) or not sentry.get("results"):
        return [f"none on this machine (run `attnkit tune {spec.name}`)"]
    if sentry.get("version", "") != (spec.version or ""):
        return [f"stale: measured with {sentry.get('distribution')} {sentry.get('version')!r}, installed "
                f"{spec.version!r}; not used (run `attnkit tune {spec.name}`)"]
    lines = [f"cache: {cache_path()}"]
    try:
        lines.extend(_result_line(r) for r in sentry["results"])
        for s in sentry.get("skipped", ()):
            where = f"L={s['length']}" if s.get("length") is not None else "all lengths"
            lines.append(f"{where} skipped: {s.get('reason', '')}")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        _warn_corrupt(cache_path(), f"malformed entry ({type(exc).__name__}: {exc})")
        return [f"the cache {cache_path()} is malformed (run `attnkit tune --clear`)"]
    return lines


def _show(say: Callable[[str], Any], registry: Any) -> None:
    path = cache_path()
    _refresh()
    data = _data()
    say(f"tuning cache: {path}" + ("" if data else " (none)"))
    if not data:
        return
    fp = fingerprint()
    key = _machine_key(fp)
    machines = data.get("machines", {})
    others = [k for k in machines if k != key]
    entry = machines.get(key)
    if not isinstance(entry, dict) or not entry.get("specs"):
        say(f"nothing measured for this machine ({key})")
    else:
        say(f"this machine: {key} (updated {entry.get('updated', '?')})")
        for skey, sentry in sorted(entry["specs"].items()):
            try:
                spec = registry.resolve(skey)
                installed = spec.version or ""
            except Exception:  # noqa: BLE001 - an uninstalled plugin's entry is still shown
                installed = None
            state = "" if installed == sentry.get("version", "") else \
                " [not installed]" if installed is None else f" [stale: installed {installed!r}]"
            say(f"{skey} {sentry.get('version', '')}{state}".rstrip())
            for r in sentry.get("results", ()):
                say("  " + _result_line(r))
            for s in sentry.get("skipped", ()):
                where = f"L={s['length']}" if s.get("length") is not None else "all lengths"
                say(f"  {where} skipped: {s.get('reason', '')}")
    if others:
        say(f"entries for other machines or torch versions (ignored here): {len(others)}")
        for k in sorted(others):
            say(f"  {k}")


# ------------------------------------------------------------------ command line
def _parse_lengths(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise UsageError(f"--lengths: expected comma-separated ints such as 256,1024, got {text!r}")
    out = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise UsageError(f"--lengths: {p!r} is not an int (expected e.g. 256,1024)") from None
        if not 1 <= n <= MAX_LENGTH:
            raise UsageError(f"--lengths: each length must be in 1..{MAX_LENGTH}, got {n}")
        out.append(n)
    return tuple(out)


def configure_tune(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``attnkit tune``.

    ``attnkit tune [NAMES] [--lengths 256,1024] [--repeats N] [--device cpu] [--dtype float32] [--clear] [--show]``
    """
    parser.add_argument("names", nargs="*", metavar="NAME", help="names to measure (default: all installed)")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), metavar="L1,L2",
                        help=f"sequence lengths to measure, each in 1..{MAX_LENGTH} (default: %(default)s)")
    parser.add_argument("--repeats", default="3", metavar="N",
                        help=f"timed calls per case, 1..{MAX_REPEATS}; the median is kept (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="device to measure on, e.g. cpu, cuda (default: %(default)s)")
    parser.add_argument("--dtype", default="float32",
                        help=f"one of {', '.join(DTYPES)} (default: %(default)s)")
    parser.add_argument("--clear", action="store_true",
                        help="remove the cache (backend='auto' goes back to the static choice); with NAMEs, "
                             "then measure them")
    parser.add_argument("--show", action="store_true",
                        help="print the cache (alone: without measuring)")


def run_tune(args: argparse.Namespace, registry: Any = None) -> int:
    """Run ``attnkit tune``; 0 on success, 1 when a mechanism named on the command line had no backend that ran.

    Without NAMEs every installed mechanism is measured. ``--clear`` removes the
    cache first (alone: only that); ``--show`` prints the cache (alone: without
    measuring; with NAMEs: after measuring).

    Raises:
        UsageError: an out-of-range or malformed value.
    """
    from .registry import default_registry

    reg = registry or default_registry()
    lengths = _parse_lengths(args.lengths)
    try:
        repeats = int(args.repeats)
    except (TypeError, ValueError):
        raise UsageError(f"--repeats: expected an int in 1..{MAX_REPEATS}, got {args.repeats!r}") from None
    if not 1 <= repeats <= MAX_REPEATS:
        raise UsageError(f"--repeats: expected an int in 1..{MAX_REPEATS}, got {repeats}")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype: expected one of {', '.join(DTYPES)}, got {args.dtype!r}")
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device: expected a torch device such as cpu or cuda, got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available here")
    names = list(args.names or [])
    for n in names:
        reg.resolve(n)  # an unknown name: a clear error before any measuring
    if args.clear:
        path = cache_path()
        try:
            removed = clear()
        except OSError as exc:
            raise UsageError(f"--clear: cannot remove the tuning cache {path}: {exc}") from None
        print(f"removed {path}" if removed else f"no tuning cache at {path}")
    if (args.clear or args.show) and not names:
        if args.show:
            _show(print, reg)
        return 0
    try:
        result = tune(names or None, lengths=lengths, repeats=repeats, device=device, dtype=DTYPES[args.dtype],
                      progress=print, registry=reg)
    except InvalidInputError as exc:
        raise UsageError(str(exc)) from exc
    except OSError as exc:  # the measurements themselves never raise it: a failing backend is a result
        raise UsageError(f"cannot write the tuning cache {cache_path()}: {exc} (set {ENV_CACHE_DIR} to a "
                         "writable directory)") from None
    if args.show:
        _show(print, reg)
    code = 0
    for sentry in result["specs"].values():
        runs = sentry["results"]
        if runs and not any(r["winner"] for r in runs):
            print(f"{sentry['name']}: no backend ran; see the errors above")
            code = 1 if names else code  # tuning everything: one unbuildable mechanism is not a failure
    return code
