"""``clustered`` and ``improved-clustered``: the module (``module.py``) and its plain reference (``naive.py``)."""
