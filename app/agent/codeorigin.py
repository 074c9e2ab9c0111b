"""Whether an upgrade would change the code this agent runs.

An upgrade installs llmgw with this interpreter's pip, into its
environment's site-packages, then re-executes `python -m app.cli` in the
same working directory (upgrade.py). That imports the first `app` package
on its search path: the working directory's, then PYTHONPATH's, then the
environment's. So an agent started in a checkout, or in the shipped image
(whose working directory /opt/llmgw holds the `app/` it was built from), or
from an editable install, comes back on its old code after an upgrade
answered 200. And where site-packages is not writable to the agent's user
(the image's, owned by root), pip falls back to a user install, or fails.
Both are found here, before anything is installed, and the upgrade is
refused with the reason (docs/design/node-operations.md).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence


def _installed_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


def code_origin_problem(
    cwd: str | None = None, path: Sequence[str] | None = None,
    install_dirs: Sequence[str] | None = None,
    can_write: Callable[[str], bool] = lambda d: os.access(d, os.W_OK),
) -> str | None:
    """Why `python -m app.cli`, run again in `cwd` on `path` (default: this
    process's, less its first entry, the script's folder or the working
    directory) would not import the llmgw that pip installs into
    `install_dirs` (default: this interpreter's site-packages); None if it
    would."""
    dirs = list(install_dirs if install_dirs is not None else _installed_dirs())
    search = [cwd if cwd is not None else os.getcwd(),
              *(path if path is not None else sys.path[1:])]
    spec = importlib.machinery.PathFinder.find_spec("app", search)
    where = (list(spec.submodule_search_locations or [])[:1]
             if spec is not None else [])
    expected = {os.path.realpath(os.path.join(d, "app")) for d in dirs}
    if not where:
        return ("no `app` package is on this agent's search path (an editable install?): "
                "an upgrade would not change the code it runs")
    if os.path.realpath(where[0]) not in expected:
        return (f"a restarted agent would import llmgw from {where[0]}, not from "
                f"{' or '.join(dirs)}, where pip installs: an upgrade would leave it on its "
                "old code (started in a checkout, or in the image, whose sources lie in its "
                "working directory?). Install llmgw into an environment of its own and start "
                "the agent outside the sources, or upgrade the image instead")
    unwritable = [d for d in dirs if not can_write(d)]
    if unwritable:
        return (f"this agent's user cannot write to {unwritable[0]}, where pip installs "
                "(the image's environment belongs to root): upgrade the image instead")
    return None
