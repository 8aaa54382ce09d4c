"""Which distribution of this repository provides (or will provide) which name.

Used only to word errors: an unknown name gets an install suggestion when,
and only when, a distribution is known to provide it. Names of families not
yet released say so instead of suggesting a package that does not exist.
"""

from __future__ import annotations

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


def install_hint(name: str) -> str:
    """A sentence on where ``name`` comes from, or '' when no distribution is known to provide it."""
    found = provider(name)
    if found is None:
        return ""
    dist, released = found
    path = "plugins/" + dist
    if released:
        return f" It comes with {dist}: pip install {dist} (from a checkout: pip install ./{path})."
    return f" It is planned for {dist}, which is not released yet."
