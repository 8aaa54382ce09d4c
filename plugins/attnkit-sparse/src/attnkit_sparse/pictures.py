"""Draw every pattern's picture for the docs: ``python -m attnkit_sparse.pictures [OUT_DIR]``.

One small PNG per registered pattern (``<OUT_DIR>/<name>.png``, default
``docs/images/sparse``), each drawn by ``attnkit describe NAME --plot`` from
the pattern's own block index, with small options so the structure shows at
L = 64 (128 for BigBird). Run by ``nox -s pictures``; ``block-sparse`` has no
pattern of its own and gets none.
"""

from __future__ import annotations

import sys
from pathlib import Path

from attnkit.cli import main as attnkit_main

#: (name, length, causal, options) of each picture
PICTURES = (
    ("local", 64, False, ("window=9",)),
    ("dilated", 64, False, ("window=5", "dilation=3")),
    ("block-local", 64, False, ("block_size=8",)),
    ("global", 64, False, ("window=7", "global_positions=[0, 32]")),
    ("random", 64, False, ("block_size=8", "num_random=2", "seed=0")),
    ("longformer", 64, False, ("window=8", "global_positions=[0, 40]")),
    ("bigbird", 128, False, ("block_size=8",)),
    ("strided", 64, True, ("stride=8",)),
    ("fixed", 64, True, ("stride=8", "c=2")),
    ("local-2d", 64, False, ("window=3",)),
    ("axial", 64, False, ()),
    ("bp-transformer", 64, False, ("k=2",)),
)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "docs/images/sparse")
    out.mkdir(parents=True, exist_ok=True)
    for name, length, causal, options in PICTURES:
        argv_ = ["describe", name, "--plot", str(out / f"{name}.png"), "--length", str(length)]
        argv_ += ["--causal"] if causal else []
        for o in options:
            argv_ += ["-o", o]
        code = attnkit_main(argv_)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
