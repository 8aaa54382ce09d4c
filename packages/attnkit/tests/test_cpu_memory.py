"""attnkit.cpu_memory.keep_freed_memory: the arguments checked, and in a fresh process (the setting is
process-wide) a large block freed and allocated again, round after round, comes back without page faults."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnkit.cpu_memory import MAX_RETAIN_MIB, keep_freed_memory
from attnkit.errors import InvalidInputError

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# a training loop in miniature: nine rounds of a 64 MiB tensor allocated, filled and freed; the page faults of
# the last six, per round (the heap settles on its blocks in the first rounds: the first two or three fault
# either way). One steady-state round in a CI run once faulted the whole block in again (16,384 faults, the
# process's other threads at work on a busy two-core machine), so the test reads the typical round, the median.
_CHILD = textwrap.dedent("""
    import resource, sys
    import torch
    from attnkit.cpu_memory import keep_freed_memory
    applied = keep_freed_memory() if sys.argv[1] == "keep" else None
    faults = []
    for _ in range(9):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.empty(16 * 2**20, dtype=torch.float32); x.fill_(1.0); del x
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    print(applied, *faults[3:])
""")


def _faults(mode: str) -> tuple[str, int]:
    """The median page faults of the steady-state rounds, times 3 (the scale of the three rounds it used to sum)."""
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    per_round = sorted(int(x) for x in out[1:])
    return out[0], 3 * per_round[len(per_round) // 2]


@pytest.mark.parametrize(("kw", "name"), [({"retain_mib": 0}, "retain_mib"), ({"retain_mib": MAX_RETAIN_MIB + 1},
                                          "retain_mib"), ({"retain_mib": 1.5}, "retain_mib"),
                                          ({"retain_mib": True}, "retain_mib"), ({"top_pad_mib": -1}, "top_pad_mib")])
def test_bad_arguments_name_the_argument(kw: dict, name: str) -> None:
    with pytest.raises(InvalidInputError, match=name):
        keep_freed_memory(**kw)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_a_freed_block_is_reused_without_faults() -> None:
    applied, faults = _faults("keep")
    assert applied == "True"
    assert faults < 1024, (f"{faults} page faults in three rounds of a 64 MiB block (3 x 16,384 4-KiB pages) "
                           "after the call")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" not in thp.read_text():   # the control: without the call it faults each page
        _, control = _faults("plain")
        assert control > 24000, f"expected a fresh mmap each round (~49,152 faults) without the call, got {control}"


@pytest.mark.skipif(GLIBC, reason="the non-glibc answer")
def test_without_glibc_it_changes_nothing() -> None:
    assert keep_freed_memory() is False


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt only")
def test_keeps_freed_memory_tells_whether_the_process_keeps_it() -> None:
    """False in a fresh process, True after a :func:`keep_freed_memory` that took its settings, and True from the
    start under ``MALLOC_MMAP_MAX_=0`` (the environment's form of the same setting). A fresh process each: the
    setting is process-wide."""
    child = ("from attnkit.cpu_memory import keep_freed_memory, keeps_freed_memory\n"
             "before = keeps_freed_memory(); applied = keep_freed_memory()\n"
             "print(before, applied, keeps_freed_memory())")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_MAX_"}
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, timeout=120,
                         env=env).stdout.split()
    assert out == ["False", "True", "True"]
    probe = "from attnkit.cpu_memory import keeps_freed_memory; print(keeps_freed_memory())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120,
                         env={**env, "MALLOC_MMAP_MAX_": "0"}).stdout.split()
    assert out == ["True"]
