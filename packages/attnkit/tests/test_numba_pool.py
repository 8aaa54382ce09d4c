"""``attnkit.numba_pool`` is what plugins' numba kernels share; the core itself never imports numba."""

from __future__ import annotations

import subprocess
import sys


def test_importing_attnkit_does_not_import_numba():
    code = "import sys, attnkit, attnkit.numba_pool; assert 'numba' not in sys.modules, 'numba imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
