"""Hook specifications (specs only) of the ``attnkit`` plugin API."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("attnkit")
hookimpl = pluggy.HookimplMarker("attnkit")


@hookspec
def attnkit_register_attention(register):
    """Register attention implementations by calling ``register(spec_or_class, **spec_fields)``."""


@hookspec
def attnkit_register_commands(cli):
    """Add CLI subcommands with ``cli.add_command(name, help=..., configure=..., run=...)``."""


@hookspec
def attnkit_register_block(register):
    """Register block-level mechanisms by calling ``register(block_spec)`` (an :class:`attnkit.BlockSpec`)."""
