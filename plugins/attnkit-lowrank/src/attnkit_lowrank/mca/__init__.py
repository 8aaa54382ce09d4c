"""``memory-compressed`` (alias ``mca``): the module (``module.py``) and its plain reference (``naive.py``)."""
