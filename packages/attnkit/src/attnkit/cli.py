"""The ``attnkit`` command line: ``list``, ``describe``, ``check`` and plugin commands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ._version import __version__
from .errors import AttnkitError, InvalidInputError, PluginLoadError, UsageError
from .registry import Registry, default_registry

BUILTIN_COMMANDS = ("list", "describe", "check", "tune")
#: commands that come with attnkit-lab (named in the error when the lab is not installed)
LAB_COMMANDS = ("bench", "error", "train", "demo")


class CommandLine:
    """What ``attnkit_register_commands(cli)`` receives."""

    def __init__(self, subparsers: Any) -> None:
        self._subparsers = subparsers
        self.commands: dict[str, Callable[[argparse.Namespace], int | None]] = {}

    def add_command(self, name: str, *, help: str,
                    configure: Callable[[argparse.ArgumentParser], None] | None = None,
                    run: Callable[[argparse.Namespace], int | None]) -> argparse.ArgumentParser:
        """Add ``attnkit NAME``: ``configure(parser)`` adds arguments, ``run(args)`` returns an exit code."""
        if not isinstance(name, str) or not name or name.startswith("-"):
            raise InvalidInputError(f"add_command: name must be a command word, got {name!r}")
        if name in self.commands or name in BUILTIN_COMMANDS and self.commands.get(name) is not None:
            raise InvalidInputError(f"add_command: the command {name!r} already exists")
        if not callable(run):
            raise InvalidInputError(f"add_command: run must be callable, got {type(run).__name__}")
        parser = self._subparsers.add_parser(name, help=help, description=help)
        if configure is not None:
            configure(parser)
        self.commands[name] = run
        parser.set_defaults(_command=name)
        return parser


# ------------------------------------------------------------------ formatting
def _caps_flags(spec: Any) -> str:
    c = spec.capabilities
    flags = []
    if c.causal:
        flags.append("causal")
    if not c.noncausal:
        flags.append("causal-only")
    if c.key_padding_mask:
        flags.append("padding")
    if c.attn_mask:
        flags.append("mask")
    if c.cross:
        flags.append("cross")
    if c.streaming:
        flags.append(f"stream:{c.streaming}")
    return ",".join(flags) or "-"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def _cmd_list(args: argparse.Namespace, reg: Registry) -> int:
    specs = reg.specs()
    records = reg.plugin_records()
    if args.json:
        print(json.dumps({
            "attention": [s.as_dict() for s in specs],
            "blocks": [b.as_dict() for b in reg.blocks()],
            "plugins": [r.as_dict() for r in records],
        }, indent=2))
        return 0
    rows = []
    for s in sorted(specs, key=lambda s: (s.family, s.name)):
        rows.append([
            s.name + (f" ({', '.join(s.aliases)})" if s.aliases else ""),
            s.family,
            f"{s.distribution} {s.version}".strip(),
            "exact" if s.exact else "approx",
            _caps_flags(s),
            ",".join(s.capabilities.backends),
        ])
    print(_table(rows, ["name", "family", "plugin", "kind", "capabilities", "backends"]))
    blocks = reg.blocks()
    if blocks:
        print("\nblocks:")
        brows = [[b.name + (f" ({', '.join(b.aliases)})" if b.aliases else ""), b.family,
                  f"{b.distribution} {b.version}".strip(), b.summary] for b in sorted(blocks, key=lambda b: b.name)]
        print(_table(brows, ["name", "family", "plugin", "summary"]))
    bad = [r for r in records if r.status in ("broken", "skipped")]
    blocked = [r for r in records if r.status == "blocked"]
    if bad:
        print("\nplugins that failed to load:")
        for r in bad:
            print(f"  {r.name} ({r.distribution} {r.version}) [{r.status}]: {r.error}")
    if blocked:
        print("\nplugins not loaded: " + ", ".join(f"{r.name} ({r.error})" for r in blocked))
    return 0


def _with_options(spec: Any) -> dict[str, Any]:
    """``spec.as_dict(with_options=True)``; a factory that does not import is a clear error, not a traceback."""
    try:
        return spec.as_dict(with_options=True)
    except Exception as exc:  # noqa: BLE001
        raise PluginLoadError(
            spec.plugin or spec.name,
            f"cannot import the factory {spec.factory_path} of {spec.name!r} to read its options: "
            f"{type(exc).__name__}: {exc}") from None


def _cmd_describe_block(args: argparse.Namespace, reg: Registry, spec: Any) -> int:
    if args.plot is not None:
        raise UsageError(f"describe --plot: {spec.name!r} is a block; --plot draws an attention's pattern")
    d = _with_options(spec)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    _print_header(spec, f"{spec.name} (block)")
    print(f"  streaming:     {spec.streaming or '-'}")
    if spec.aux_losses:
        print(f"  aux losses:    {dict(spec.aux_losses)}")
    print("  build:         attnkit.build_block(name, dim=..., num_heads=..., attention=..., **options)")
    _print_options(d["options"])
    return 0


def _print_header(spec: Any, title: str) -> None:
    print(f"{title} — {spec.summary}")
    print(f"  family:        {spec.family} ({spec.qualified_name})")
    if spec.aliases:
        print(f"  aliases:       {', '.join(spec.aliases)}")
    print(f"  provided by:   {spec.distribution} {spec.version} (plugin {spec.plugin})")
    print(f"  factory:       {spec.factory_path}")
    if spec.paper:
        print(f"  paper:         {spec.paper}")


def _print_options(options: list[dict[str, Any]]) -> None:
    print("  options:")
    for o in options:
        default = "(required)" if o["required"] else f"= {o['default']!r}"
        print(f"    {o['name']}: {o['type']} {default}")
        if o["help"]:
            print(f"        {o['help']}")


def _cmd_describe(args: argparse.Namespace, reg: Registry) -> int:
    try:
        spec = reg.resolve(args.name)
    except LookupError:
        try:
            block = reg.resolve_block(args.name)
        except LookupError:
            block = None
        if block is None:
            raise
        return _cmd_describe_block(args, reg, block)
    if args.plot is not None:
        return _cmd_plot(args, reg, spec)
    if args.option or args.causal or args.length is not None:
        raise UsageError("describe: --option, --length and --causal go with --plot FILE")
    d = _with_options(spec)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    _print_header(spec, spec.name)
    print(f"  exact:         {'yes' if spec.exact else 'no: ' + (spec.approximation or 'approximate')}")
    if spec.error_bound is not None:
        print(f"  error bound:   {spec.error_bound} (relative, conformance-kit distribution)")
    print(f"  reference:     {spec.reference_path or '- (none declared)'}")
    if spec.aux_losses:
        print(f"  aux losses:    {dict(spec.aux_losses)} (name: default weight)")
    print("  capabilities:")
    for k, v in spec.capabilities.as_dict().items():
        if isinstance(v, (list, tuple)):
            v = ", ".join(v) or "-"
        print(f"    {k:22} {v if v not in (None, '') else '-'}")
    if spec.defaults:
        print(f"  defaults:      {dict(spec.defaults)}")
    _print_options(d["options"])
    tuning = _tuning()
    if tuning is not None:
        lines = tuning.describe_lines(spec)
        if lines:
            print("  measured (attnkit tune):")
            for line in lines:
                print(f"    {line}")
    return 0


def pattern_picture(attn: Any, L: int, S: int, *, causal: bool = False, block_size: int | None = None) -> Any:
    """What ``describe --plot`` draws: ``(allowed (L, S) bool, tile states (NQ, NK) int8, block size)`` or None.

    Read from the mask's block index, the one the engine executes: FULL tiles
    are allowed throughout, SKIP tiles nowhere, and only PARTIAL tiles are
    evaluated element by element (batch element 0, head 0).
    """
    import torch

    from .masks import FULL, PARTIAL, Geometry

    mask = attn.pattern_mask(L, S, causal=causal)
    if mask is None:
        return None
    bq = bk = block_size or max(1, min(64, max(L, S) // 8))
    H = attn.num_heads or 1
    state = mask.block_index(1, H, L, S, block_size=(bq, bk)).state[0, 0]
    allowed = torch.zeros(L, S, dtype=torch.bool)
    geom = Geometry(1, H, L, S, torch.device("cpu"))
    for t, u in (state != 0).nonzero().tolist():
        q0, k0 = t * bq, u * bk
        q1, k1 = min(L, q0 + bq), min(S, k0 + bk)
        if state[t, u] == FULL:
            allowed[q0:q1, k0:k1] = True
        elif state[t, u] == PARTIAL:
            qi = torch.arange(q0, q1).view(1, 1, -1, 1)
            ki = torch.arange(k0, k1).view(1, 1, 1, -1)
            keep = mask._keep(torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                              qi, ki, geom)
            allowed[q0:q1, k0:k1] = keep.expand(1, 1, q1 - q0, k1 - k0)[0, 0]
    return allowed, state, (bq, bk)


def _cmd_plot(args: argparse.Namespace, reg: Registry, spec: Any) -> int:
    L = 64 if args.length is None else args.length
    if L < 1:
        raise UsageError(f"describe --length: expected an int >= 1, got {L}")
    # the caller's own values are checked first: a wrong option is reported whether or not matplotlib is here
    options = parse_options(spec, args.option) if args.option else {}
    try:
        import matplotlib
    except ImportError:
        raise UsageError("describe --plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(or pip install 'attnkit-sparse[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attn = reg.build(spec.qualified_name if spec.distribution else spec.name, **options)
    picture = pattern_picture(attn, L, L, causal=args.causal)
    if picture is None:
        raise UsageError(f"describe --plot: {spec.name!r} has no static pattern of its own (its pattern_mask() is "
                         "None: dense, content-based or kernelized attention, or one that runs the caller's mask); "
                         "nothing to draw")
    allowed, state, (bq, bk) = picture
    import numpy as np

    img = np.full((L, L, 3), 1.0)
    img[np.repeat(np.repeat(state.numpy() != 0, bq, 0), bk, 1)[:L, :L]] = (0.88, 0.92, 0.98)  # visited tiles
    img[allowed.numpy()] = (0.12, 0.32, 0.62)
    fig, ax = plt.subplots(figsize=(3.6, 3.8), dpi=100)
    ax.imshow(img, interpolation="nearest")
    for x in range(0, L + 1, bk):
        ax.axvline(x - 0.5, color="0.75", lw=0.4)
    for y in range(0, L + 1, bq):
        ax.axhline(y - 0.5, color="0.75", lw=0.4)
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    pairs = int(allowed.sum())
    ax.set_title(f"{spec.name}{' (' + opts + ')' if opts else ''}{' causal' if args.causal else ''}\n"
                 f"L={L}: {pairs} of {L * L} pairs, tiles {bq}x{bk}", fontsize=8)
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    ax.tick_params(labelsize=6)
    fig.tight_layout()
    fig.savefig(args.plot)
    plt.close(fig)
    print(f"wrote {args.plot}: {spec.name} L={L}{' causal' if args.causal else ''}, {pairs} allowed pairs "
          f"(dark), visited tiles of {bq}x{bk} (light)")
    return 0


def _tuning() -> Any:
    try:
        from . import tuning
    except ImportError:
        return None
    return tuning


def _split_option(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise UsageError(f"--option: expected KEY=VALUE, got {text!r}")
    key, _, raw = text.partition("=")
    return key.strip(), raw


def parse_options(spec: Any, texts: list[str]) -> dict[str, Any]:
    """``-o KEY=VALUE`` texts parsed by ``spec``'s option schema (bool ``False`` is False, not a string).

    Raises:
        UsageError: no ``=``, an option the implementation does not take (listing the valid ones), or
            a value that fits none of the option's types or its range.
    """
    from .options import check_value, parse_text

    _with_options(spec)  # a factory that does not import: a clear error first
    schema = {o.name: o for o in spec.resolved_options()}
    out: dict[str, Any] = {}
    for text in texts:
        key, raw = _split_option(text)
        if key not in schema:
            raise UsageError(f"--option {key}: {spec.name!r} takes no option {key!r}; "
                             f"valid: {', '.join(schema)}")
        try:
            value = parse_text(schema[key], raw)
            check_value(f"--option {key}", schema[key], value)
        except (ValueError, InvalidInputError) as exc:
            raise UsageError(f"--option {key}: {exc}") from None
        out[key] = value
    return out


def _cmd_check(args: argparse.Namespace, reg: Registry) -> int:
    from .testing.checks import run_conformance

    clashes: list[str] = []
    if args.names:
        targets = [(n, None) for n in args.names]
        for n, _ in targets:
            reg.resolve(n)  # unknown or ambiguous names: a clear error before any work
    else:  # every installed name, once per provider; a clash is reported and fails the run, not fatal
        targets, clashes = _check_targets(reg.specs())
        for line in clashes:
            print(f"attnkit check: {line}", file=sys.stderr)
    failed = len(clashes)
    reports = []
    for name, _ in targets:
        options = parse_options(reg.resolve(name), args.option) if args.option else {}
        report = run_conformance(name, options=options or None, registry=reg)
        reports.append(report)
        if not report.ok:
            failed += 1
        if not args.json:
            print(report.format())
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
    else:
        conform = sum(r.ok for r in reports)
        print(f"\n{conform} of {len(targets)} implementation(s) conform.")
        if clashes:
            print(f"{len(clashes)} name clash(es) (see above): `attnkit.build(name)` refuses these names until "
                  "one provider is uninstalled or blocked (ATTNKIT_DISABLE_PLUGINS).")
    return 1 if failed else 0


def _check_targets(specs: list[Any]) -> tuple[list[tuple[str, Any]], list[str]]:
    """What ``attnkit check`` without names runs: each spec once (a name several plugins register is
    qualified with its distribution, or its plugin when one distribution registers it twice), and one
    line per clash naming the providers."""
    by_name: dict[str, list[Any]] = {}
    for s in specs:
        by_name.setdefault(s.name, []).append(s)
    targets, clashes = [], []
    for s in specs:
        same = by_name[s.name]
        if len(same) == 1:
            targets.append((s.name, s))
            continue
        dists = [o.distribution or o.plugin for o in same]
        qualifier = s.distribution if s.distribution and dists.count(s.distribution) == 1 else s.plugin
        targets.append((f"{qualifier}:{s.name}", s))
        if s is same[0]:
            providers = ", ".join(f"{o.distribution or o.plugin} (plugin {o.plugin})" for o in same)
            clashes.append(f"the name {s.name!r} is registered by more than one distribution: {providers}; "
                           "checking each as distribution:name")
    return targets, clashes


# ------------------------------------------------------------------ entry point
def build_parser(reg: Registry) -> tuple[argparse.ArgumentParser, CommandLine]:
    parser = argparse.ArgumentParser(
        prog="attnkit",
        description="Efficient attention mechanisms behind one contract: list, describe and check them.",
    )
    parser.add_argument("--version", action="version", version=f"attnkit {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    cli = CommandLine(sub)

    def configure_list(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON (specs and plugin records)")

    def configure_describe(p: argparse.ArgumentParser) -> None:
        p.add_argument("name", help="registered name, alias, family/name or distribution:name")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--plot", metavar="FILE", help="draw the pattern's allowed (query, key) pairs from its "
                       "block index into FILE (.png, .svg, ...; needs matplotlib)")
        p.add_argument("--length", type=int, metavar="N", help="with --plot: queries and keys (default 64)")
        p.add_argument("--causal", action="store_true", help="with --plot: the causal form")
        p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                       help="with --plot: build option, repeatable, e.g. -o window=8")

    def configure_check(p: argparse.ArgumentParser) -> None:
        p.add_argument("names", nargs="*", metavar="NAME", help="names to check (default: all installed)")
        p.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                       help="build option (JSON value), repeatable, e.g. -o num_features=64")
        p.add_argument("--json", action="store_true", help="print JSON")

    cli.add_command("list", help="list installed attention implementations and plugins",
                    configure=configure_list, run=lambda a: _cmd_list(a, reg))
    cli.add_command("describe", help="show one implementation's spec, capabilities and options",
                    configure=configure_describe, run=lambda a: _cmd_describe(a, reg))
    cli.add_command("check", help="run the conformance kit on installed implementations",
                    configure=configure_check, run=lambda a: _cmd_check(a, reg))
    tuning = _tuning()
    if tuning is not None and hasattr(tuning, "run_tune"):
        cli.add_command("tune", help="time each backend of each mechanism here; backend='auto' then uses the winners",
                        configure=tuning.configure_tune, run=lambda a: tuning.run_tune(a, reg))
    reg.call_command_hooks(cli)
    return parser, cli


def _lab_missing(command: str, reg: Registry) -> str:
    """Why ``attnkit COMMAND`` (a lab command) is not there, and how to get it."""
    lab = [r for r in reg.plugin_records() if r.distribution == "attnkit-lab" or r.name == "lab"]
    if lab and lab[0].status != "loaded":
        r = lab[0]
        return (f"the command {command!r} comes with attnkit-lab, which is installed but not loaded "
                f"({r.status}: {r.error}); see `attnkit list`")
    return (f"the command {command!r} comes with attnkit-lab, which is not installed; attnkit-lab is not on "
            "the package index yet: install it from a checkout of attnkit with "
            "`pip install ./packages/attnkit-lab`")


def main(argv: list[str] | None = None, *, registry: Registry | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failure, 2 usage error)."""
    reg = registry or default_registry()
    try:
        parser, cli = build_parser(reg)
    except AttnkitError as exc:  # strict plugin loading
        print(f"attnkit: error: {exc}", file=sys.stderr)
        return 2
    words = list(sys.argv[1:] if argv is None else argv)
    first = next((w for w in words if not w.startswith("-")), None)
    if first in LAB_COMMANDS and first not in cli.commands:
        print(f"attnkit: error: {_lab_missing(first, reg)}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    command = getattr(args, "_command", None)
    if command is None:
        parser.print_help()
        return 2
    try:
        code = cli.commands[command](args)
    except (AttnkitError, LookupError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args and not isinstance(exc, AttnkitError) else exc
        print(f"attnkit {command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnkit {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
