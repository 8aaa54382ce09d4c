"""Where a test run's numba compile time goes: a pytest plugin, and a summary of what it recorded.

The plugin listens to numba's ``numba:compile`` events and sums, per dispatcher and signature, the seconds
each compile took (inclusive of the compiles nested in it, which are listed apart, indented), and the test that
first compiled it. Every process (each pytest-xdist worker too) writes ``<prefix>.<worker>.json`` and
``<prefix>.<worker>.tests.json`` at its end. Run a suite on a cold cache::

    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=packages/attnkit/benchmarks NBPROF_OUT=/tmp/sparse \\
        pytest -q -p no:cacheprovider -p numba_compile_profile -n 2 --dist loadfile \\
        plugins/attnkit-sparse/tests -m "not triton"
    python packages/attnkit/benchmarks/numba_compile_profile.py /tmp/sparse 40

A signature counted twice was compiled by two processes (two workers reached it before either had cached it).
Figures: docs/benchmarks.md, "CI time". Nothing here is a test.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

_stack: list[float] = []
_seconds: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
#: the test running now, and the first test that compiled each entry (``<prefix>.<worker>.tests.json``)
_test: list[str] = ["(collection)"]
_first: dict[str, str] = {}


def _install() -> None:
    from numba.core import event

    class _Listener(event.Listener):
        def on_start(self, ev):
            _stack.append(time.perf_counter())

        def on_end(self, ev):
            t0 = _stack.pop()
            disp = (ev.data or {}).get("dispatcher")
            fn = getattr(disp, "py_func", None)
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', disp)}"
            key = ("  (nested) " if _stack else "") + f"{name} {(ev.data or {}).get('args')}"
            _seconds[key][0] += 1
            _seconds[key][1] += time.perf_counter() - t0
            _first.setdefault(key, _test[0])

    event.register("numba:compile", _Listener())


def pytest_configure(config) -> None:
    _install()


def pytest_runtest_setup(item) -> None:
    _test[0] = item.nodeid


def pytest_sessionfinish(session, exitstatus) -> None:
    prefix = os.environ.get("NBPROF_OUT", "numba_compile_profile")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{prefix}.{worker}.json", "w") as f:
        json.dump(dict(_seconds), f)
    with open(f"{prefix}.{worker}.tests.json", "w") as f:
        json.dump(_first, f)


def summary(prefix: str, top: int = 40) -> None:
    """Print the total of the top-level compiles and the ``top`` longest entries over every process's file."""
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    first: dict[str, set[str]] = collections.defaultdict(set)
    for path in glob.glob(f"{prefix}.*.json"):
        with open(path) as f:
            data = json.load(f)
        if path.endswith(".tests.json"):
            for key, test in data.items():
                first[key].add(test)
            continue
        for key, (count, secs) in data.items():
            total[key][0] += count
            total[key][1] += secs
    rows = sorted(total.items(), key=lambda kv: -kv[1][1])
    print(f"top-level compile seconds: {sum(s for k, (_, s) in rows if not k.startswith('  ')):.1f}")
    for key, (count, secs) in rows[:top]:
        print(f"{secs:7.1f} {count:3d}  {key[:200]}")
        if not key.startswith("  "):
            print(f"             first compiled by: {', '.join(sorted(first[key]))[:300]}")


if __name__ == "__main__":
    summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
