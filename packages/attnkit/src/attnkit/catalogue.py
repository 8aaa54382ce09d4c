"""Which distribution of this repository provides (or will provide) which name.

Used only to word errors: an unknown name gets an install suggestion when,
and only when, a distribution is known to provide it. Names of families not
yet released say so instead of suggesting a package that does not exist.
"""

from __future__ import annotations

from collections.abc import Mapping

#: distribution -> (released, names and aliases)
CATALOGUE: dict[str, tuple[bool, tuple[str, ...]]] = {
    "attnkit-kernelized": (True, ("linear", "performer", "favor", "rfa", "fast-weight", "delta")),
    "attnkit-sparse": (False, (
        "local", "sliding-window", "band", "dilated", "block-local", "global", "random", "longformer", "bigbird",
        "strided", "fixed", "local-2d", "axial", "bp-transformer", "block-sparse", "lsh", "reformer", "routing",
        "sinkhorn")),
    "attnkit-lowrank": (False, ("linformer", "nystromformer", "nystrom", "soft", "informer", "probsparse")),
    "attnkit-memory": (False, ("transformer-xl", "compressive", "memory-tokens", "gtrxl")),
    "attnkit-adaptive": (False, ("adaptive-span", "dynamic-span", "entmax", "sparsemax", "act", "universal")),
}


def provider(name: str) -> tuple[str, bool] | None:
    """``(distribution, released)`` known to provide ``name``, or None."""
    key = name.strip().lower().rpartition(":")[2].rpartition("/")[2]
    for dist, (released, names) in CATALOGUE.items():
        if key in names:
            return dist, released
    return None


def install_hint(name: str, not_loaded: Mapping[str, str] | None = None) -> str:
    """A sentence on where ``name`` comes from, or '' when no distribution is known to provide it.

    Args:
        name: the requested name (``family/name`` and ``distribution:name`` are reduced to the name).
        not_loaded: ``{distribution: why}`` of installed distributions whose plugin did not load
            (blocked, broken, skipped): installing again would not help, so the hint says why instead.

    The distributions are not on the package index yet: the hint is the install from a checkout
    (``pip install ./plugins/<distribution>``), never a ``pip install <name>`` that could fetch
    someone else's package.
    """
    found = provider(name)
    if found is None:
        return ""
    dist, released = found
    if not_loaded and dist in not_loaded:
        return f" {dist} provides it but is installed and not loaded ({not_loaded[dist]}); see `attnkit list`."
    if released:
        return (f" It comes with {dist}, which is not on the package index yet: install it from a checkout "
                f"of attnkit with `pip install ./plugins/{dist}`.")
    return f" It is planned for {dist}, which is not released yet."
