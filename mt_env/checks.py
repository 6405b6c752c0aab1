"""The number checks behind mt_env's argument validation: numpy scalars count as numbers, booleans do not (``True``
is an ``int`` to Python, never a sensible token id, limit or reward)."""

from __future__ import annotations

import numbers
from typing import Any


def is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
