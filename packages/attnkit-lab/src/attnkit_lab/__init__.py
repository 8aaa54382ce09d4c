"""attnkit-lab: the attnkit workbench (``attnkit bench``, ``error``, ``train``, ``demo``).

The commands are added to the ``attnkit`` CLI through the
``attnkit_register_commands`` hook in :mod:`attnkit_lab.plugin`; the modules
here are also usable from Python (``attnkit_lab.bench.run_bench`` etc.).
"""

__version__ = "0.1.0"
