"""``poolingformer``: the module (``module.py``) and its plain reference (``naive.py``)."""
