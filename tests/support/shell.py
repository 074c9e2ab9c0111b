"""Shell scripts run for real in tests, on a PATH the test builds: the real
programs it lets through, stubs of its own for the rest."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path


def link_real_tools(bindir: Path, names: Iterable[str]) -> None:
    """Makes `bindir` with a link to the real program of each of `names`
    (each must be installed here), and nothing else: a PATH of `bindir`
    lets a script find only those and whatever stubs the test adds."""
    bindir.mkdir()
    for name in names:
        real = shutil.which(name)
        assert real, f"{name} is not installed here"
        (bindir / name).symlink_to(real)
