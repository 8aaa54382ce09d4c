"""The ``attnkit`` command line: ``list``, ``describe``, ``check`` and plugin commands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ._version import __version__
from .errors import AttnkitError, InvalidInputError, UsageError
from .registry import Registry, default_registry

BUILTIN_COMMANDS = ("list", "describe", "check")


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
    bad = [r for r in records if r.status in ("broken", "skipped")]
    blocked = [r for r in records if r.status == "blocked"]
    if bad:
        print("\nplugins that failed to load:")
        for r in bad:
            print(f"  {r.name} ({r.distribution} {r.version}) [{r.status}]: {r.error}")
    if blocked:
        print("\nplugins not loaded: " + ", ".join(f"{r.name} ({r.error})" for r in blocked))
    return 0


def _cmd_describe(args: argparse.Namespace, reg: Registry) -> int:
    spec = reg.resolve(args.name)
    d = spec.as_dict(with_options=True)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"{spec.name} — {spec.summary}")
    print(f"  family:        {spec.family} ({spec.qualified_name})")
    if spec.aliases:
        print(f"  aliases:       {', '.join(spec.aliases)}")
    print(f"  provided by:   {spec.distribution} {spec.version} (plugin {spec.plugin})")
    print(f"  factory:       {spec.factory_path}")
    if spec.paper:
        print(f"  paper:         {spec.paper}")
    print(f"  exact:         {'yes' if spec.exact else 'no: ' + (spec.approximation or 'approximate')}")
    if spec.error_bound is not None:
        print(f"  error bound:   {spec.error_bound} (relative, conformance-kit distribution)")
    print("  capabilities:")
    for k, v in spec.capabilities.as_dict().items():
        if isinstance(v, (list, tuple)):
            v = ", ".join(v) or "-"
        print(f"    {k:22} {v if v not in (None, '') else '-'}")
    if spec.defaults:
        print(f"  defaults:      {dict(spec.defaults)}")
    print("  options:")
    for o in d["options"]:
        default = "(required)" if o["required"] else f"= {o['default']!r}"
        print(f"    {o['name']}: {o['type']} {default}")
        if o["help"]:
            print(f"        {o['help']}")
    return 0


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise UsageError(f"--option: expected KEY=VALUE, got {text!r}")
    key, _, raw = text.partition("=")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip(), value


def _cmd_check(args: argparse.Namespace, reg: Registry) -> int:
    options = dict(_parse_option(o) for o in args.option)
    from .testing.checks import run_conformance

    names = args.names or [s.name for s in reg.specs()]
    failed = 0
    reports = []
    for name in names:
        reg.resolve(name)  # unknown names: a clear error before any work
        report = run_conformance(name, options=options or None)
        reports.append(report)
        if not report.ok:
            failed += 1
        if not args.json:
            print(report.format())
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
    else:
        print(f"\n{len(names) - failed} of {len(names)} implementation(s) conform.")
    return 1 if failed else 0


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
    reg.call_command_hooks(cli)
    return parser, cli


def main(argv: list[str] | None = None, *, registry: Registry | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failure, 2 usage error)."""
    reg = registry or default_registry()
    try:
        parser, cli = build_parser(reg)
    except AttnkitError as exc:  # strict plugin loading
        print(f"attnkit: error: {exc}", file=sys.stderr)
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
