"""Options annotated with typing objects (no ``from __future__ import annotations``) and declared ranges."""

from typing import Any, Literal, Optional

import attnkit
from attnkit.softmax import SoftmaxAttention

ATTNKIT_API_VERSION = 1


class Typed(SoftmaxAttention):
    """Softmax attention with options of every kind the schema checks.

    Args:
        mode: a choice from a ``Literal``.
        seed: an int or None (``Optional``).
        width: an int >= 1 (declared in ``option_constraints``).
        ratio: a float in [0, 1) (declared).
        flag: a bool.
        level: 0 or 1 (``choices`` declared on an untyped option; True is not 1).
        bit: 0 or 1 from a ``Literal`` (True is not 1).
        scale: a finite float > 0 or None (the base constraint).
    """

    option_constraints = {
        "width": {"minimum": 1},
        "ratio": {"minimum": 0, "maximum": 1, "exclusive_maximum": True},
        "level": {"choices": (0, 1)},
    }

    def __init__(self, *, mode: Literal["fast", "exact"] = "fast", seed: Optional[int] = None,  # noqa: UP045 - the typing object is what is tested
                 width: int = 4, ratio: float = 0.5, flag: bool = True, level: Any = 0,
                 bit: Literal[0, 1] = 0,
                 scale: Optional[float] = None):  # noqa: UP045 - the typing object is what is tested
        super().__init__(scale=scale)
        self.mode, self.seed, self.width, self.ratio, self.flag = mode, seed, width, ratio, flag
        self.level, self.bit = level, bit


@attnkit.hookimpl
def attnkit_register_attention(register):
    register(Typed, name="typed", family="custom", summary="typed options")
