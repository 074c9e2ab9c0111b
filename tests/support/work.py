"""Work counted, not timed: the Python and C function calls a piece of code
makes, the same number every run (docs/design/scale.md: a cost that
must not grow with the fleet is checked at two sizes)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

T = TypeVar("T")


def calls(fn: Callable[[], T]) -> tuple[int, T]:
    """The function calls `fn()` makes, and its result."""
    count = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return count, out
