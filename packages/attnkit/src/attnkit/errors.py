"""Error types raised by attnkit.

Every error names the input, the reason and the fix. All derive from
:class:`AttnkitError`, and each also derives from the built-in exception a
PyTorch user would catch (``ValueError``, ``KeyError``, ...).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


class AttnkitError(Exception):
    """Base class of every error attnkit raises on purpose."""


class InvalidInputError(AttnkitError, ValueError):
    """An argument has the wrong type, shape, dtype, device or value."""


class UsageError(AttnkitError):
    """A command-line user mistake: the CLI prints it without a traceback."""


class UnknownAttentionError(AttnkitError, KeyError):
    """No installed implementation has the requested name.

    ``suggestions`` holds close registered names; ``str()`` reads as a sentence,
    not as the quoted key that ``KeyError`` would print. ``kind`` words it for
    blocks (``"block"``). An install hint is added only when this repository's
    catalogue (:mod:`attnkit.catalogue`) knows a distribution providing the name;
    ``not_loaded`` (``{distribution: why}``) turns it into the reason an installed
    distribution did not load.
    """

    def __init__(self, name: str, known: Iterable[str], *, broken: Iterable[str] = (), kind: str = "attention",
                 not_loaded: Mapping[str, str] | None = None):
        self.name = name
        self.known = sorted(set(known))
        self.suggestions = difflib.get_close_matches(name, self.known, n=3, cutoff=0.5)
        msg = f"no {kind} named {name!r} is registered"
        end = "."
        if self.suggestions:
            msg += "; did you mean " + " or ".join(repr(s) for s in self.suggestions) + "?"
            end = ""
        elif self.known:
            msg += f"; installed: {', '.join(self.known)}"
        else:
            msg += f"; no {kind} is installed (is ATTNKIT_PLUGINS set to an empty allow-list?)"
        broken = list(broken)
        if broken:
            msg += f" (plugins that failed to load: {', '.join(broken)}; see `attnkit list`)"
        from .catalogue import install_hint

        msg += end + install_hint(name, not_loaded)
        self.message = msg
        super().__init__(msg)

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class UnsupportedFeatureError(AttnkitError, ValueError):
    """An implementation was asked for something it cannot honour.

    The message names the implementation, the argument, and the installed
    implementations that do support it.
    """

    def __init__(self, implementation: str, argument: str, reason: str = "",
                 supported_by: Iterable[str] = (), *, instead: str = ""):
        self.implementation = implementation
        self.argument = argument
        self.supported_by = sorted(set(supported_by))
        msg = f"{implementation!r} does not support {argument}"
        if reason:
            msg += f": {reason}"
        if instead:                              # what to do instead, where no list of implementations applies
            msg += f". {instead}"
        elif self.supported_by:
            msg += f". Installed implementations that do: {', '.join(self.supported_by)}"
        else:
            msg += ". No installed implementation supports it"
        super().__init__(msg + ".")


class AmbiguousNameError(AttnkitError, LookupError):
    """Two or more plugins register the same name."""

    def __init__(self, name: str, providers: Iterable[tuple[str, str]]):
        self.name = name
        self.providers = sorted(set(providers))
        choices = ", ".join(f"{dist}:{name!s} ({family}/{name})" for dist, family in self.providers)
        super().__init__(
            f"the name {name!r} is registered by more than one plugin: "
            f"{', '.join(d for d, _ in self.providers)}. Select one explicitly: {choices}."
        )


class PluginLoadError(AttnkitError, RuntimeError):
    """A plugin could not be loaded (import failure, bad hook, wrong API version)."""

    def __init__(self, plugin: str, reason: str):
        self.plugin = plugin
        self.reason = reason
        super().__init__(f"plugin {plugin!r} failed to load: {reason}")


class BackendUnavailableError(AttnkitError, RuntimeError):
    """A forced backend cannot run here."""
