"""Peak memory of one ``lsh`` forward+backward at L = 16,384 (CPU), before (a git commit's ``lsh/``) or after.

Growth of the process's maximum resident size (``ru_maxrss``) during one forward+backward of
``out.sum()``, after a warm-up at L = 256 (kernels compiled); run each side in a fresh process::

    python plugins/attnkit-sparse/benchmarks/mem_lsh_before_after.py after
    python plugins/attnkit-sparse/benchmarks/mem_lsh_before_after.py before 273d38b
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile

import torch


def main() -> None:
    torch.set_num_threads(2)
    which = sys.argv[1]
    L, B, H, D = 16384, 1, 8, 64
    torch.manual_seed(0)
    q = torch.randn(B, H, L, D, requires_grad=True)
    v = torch.randn(B, H, L, D, requires_grad=True)
    from attnkit_sparse.lsh.attention import LSHAttention as After
    m = After(bucket_size=64, n_hashes=4, backend="numba")
    with tempfile.TemporaryDirectory() as tmp:
        if which == "before":
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import bench_lsh_before_after as bb
            old = bb.load_before(sys.argv[2], tmp)(bucket_size=64, n_hashes=4, backend="numba")
            old.spec = m.spec
            m = old
        s = torch.randn(1, 1, 256, D, requires_grad=True)
        m(s, s, s).sum().backward()
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m(q, q, v).sum().backward()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"{which}: peak resident growth during one 16K forward+backward {(peak - base) / 1024:.0f} MiB "
          f"(resident before it {base / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
