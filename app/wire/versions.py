"""Versions compared as both ends compare them: an agent checking which vLLM
it installed (app/agent/builds.py), a gateway checking which agents it
places replicas on (app/control/placement/agentversion.py).

As PEP 440 through `packaging` when it is installed, else by their release
numbers alone (pre/post/dev parts ignored).
"""

from __future__ import annotations

import re
from typing import Any

try:
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - packaging is present wherever pip is
    Version = None  # type: ignore[assignment,misc]
    InvalidVersion = ValueError  # type: ignore[assignment,misc]

RELEASE = re.compile(r"^v?(\d+(?:\.\d+)*)")


def parse(version: str) -> Any:
    """A comparable key for `version`; ValueError if it is not one."""
    if Version is not None:
        try:
            return Version(version)
        except InvalidVersion:
            raise ValueError(f"{version!r} is not a version") from None
    m = RELEASE.match(version.strip())
    if m is None:
        raise ValueError(f"{version!r} is not a version")
    nums = [int(x) for x in m.group(1).split(".")]
    while nums and nums[-1] == 0:
        nums.pop()
    return tuple(nums)
