"""The lab's plugin: adds ``bench``, ``error``, ``train`` and ``demo`` to the attnkit CLI.

Registered through the entry point ``attnkit.plugins: lab = attnkit_lab.plugin``,
with the same ``attnkit_register_commands`` hook third-party plugins use. Only
:mod:`attnkit_lab.cli` (argument parsing and range checks) is imported here; the
command modules (:mod:`~attnkit_lab.bench`, :mod:`~attnkit_lab.error`,
:mod:`~attnkit_lab.train`, :mod:`~attnkit_lab.demo`, and matplotlib for plots)
are imported when their command runs.
"""

from __future__ import annotations

import attnkit

from . import cli as _cli

ATTNKIT_API_VERSION = 1


@attnkit.hookimpl
def attnkit_register_commands(cli):
    cli.add_command(
        "bench",
        help="time and peak memory of attention implementations against exact SDPA over a sweep of lengths",
        configure=_cli.configure_bench, run=_cli.run_bench_cmd,
    )
    cli.add_command(
        "error",
        help="approximation error of approximate attention against exact attention, over lengths and budgets",
        configure=_cli.configure_error, run=_cli.run_error_cmd,
    )
    cli.add_command(
        "train",
        help="train the same small model once per attention on mqar, listops, copy or lm",
        configure=_cli.configure_train, run=_cli.run_train_cmd,
    )
    cli.add_command(
        "demo",
        help="a quick bench, train mqar and error report in one results directory (minutes on a CPU)",
        configure=_cli.configure_demo, run=_cli.run_demo_cmd,
    )
