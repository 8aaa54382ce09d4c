"""attnkit-lowrank: low-rank and compression attentions (``nystrom``, ``linformer``, ``soft``).

Importing this package imports nothing heavy; the modules load when built
(``attnkit.build("nystrom", ...)``) through the specs in :mod:`attnkit_lowrank.plugin`.
"""

__version__ = "0.1.0"
