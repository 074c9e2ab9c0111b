"""The agent's self-upgrade: install an llmgw version, then run it.

`POST /node/v1/upgrade {"version": "X", "index_url": optional}` (nodeapi.py)
runs the installer into the agent's own interpreter's environment and waits
for it (up to `timeout` s; the gateway waits that long plus a margin, see
app/api/nodes.py). On success it answers 200 and, once the answer is out,
asks the agent to stop cleanly (engines left running, their records saved)
and re-execute itself: `reexec_argv()` runs the same command line through
`python -m app.cli`, so the new code is imported whether the agent was
started as the `llmgw` console script or as `python -m app.cli`. The new
run adopts the engines (docs/architecture.md, "Node operations"). On
failure the agent keeps running and answers 422 with the installer's last
lines. One upgrade at a time: a second while one runs answers 409.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEFAULT_INSTALLER = "{python} -m pip install --no-deps llmgw=={version}"
# PEP 440-ish: digits, dots, letters for pre/post/dev/local parts; nothing
# that a shell or pip would read as another argument.
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]{0,63}$")
_URL = re.compile(r"^(https?|file)://[^\s]{1,2000}$")
_USERINFO = re.compile(r"(://)[^/@\s]+@")
TAIL_LINES = 20


class UpgradeError(Exception):
    """Refused or failed; `status` is the HTTP status to answer."""

    def __init__(self, status: int, title: str, detail: str, output: list[str] | None = None,
                 ) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail
        self.output = output or []


@dataclass
class UpgradeConfig:
    # Argument template, split like a shell would (no shell runs it):
    # {python} the agent's interpreter, {version} the version asked for.
    # `--index-url URL` is appended when a request names an index.
    installer: str = DEFAULT_INSTALLER
    # Extra installer arguments for every upgrade (e.g. a local wheel
    # directory: "--no-index --find-links /srv/wheels").
    extra_args: list[str] = field(default_factory=list)
    # Seconds the installer may run; then it is killed and the upgrade fails.
    timeout: float = 300.0


def check_version(version: str) -> str:
    if not _VERSION.match(version):
        raise UpgradeError(400, "Bad version", f"{version!r} is not a version (e.g. 0.2.0)")
    return version


def installer_argv(cfg: UpgradeConfig, version: str, index_url: str | None,
                   python: str = sys.executable) -> list[str]:
    """The installer's command line for `version` (checked first)."""
    check_version(version)
    argv = [a.format(python=python, version=version) for a in shlex.split(cfg.installer)]
    argv += cfg.extra_args
    if index_url:
        if not _URL.match(index_url):
            raise UpgradeError(400, "Bad index URL",
                               f"{index_url!r}: give an http(s):// or file:// URL")
        argv += ["--index-url", index_url]
    return argv


def shown(argv: list[str]) -> str:
    """`argv` for the log, an index URL's credentials masked (DESIGN
    invariant 6 in docs/architecture.md: secrets never in logs)."""
    return shlex.join(_USERINFO.sub(r"\1***@", a) for a in argv)


def reexec_argv(argv: list[str], python: str = sys.executable) -> list[str]:
    """The command line that runs this agent again on the installed code:
    `argv` is sys.argv (its [0] the console script or app/cli.py), the rest
    are the agent's own arguments, kept as they were."""
    return [python, "-m", "app.cli", *argv[1:]]


class Upgrader:
    def __init__(self, cfg: UpgradeConfig, on_installed: Callable[[str], None]) -> None:
        self.cfg = cfg
        self._on_installed = on_installed
        self._lock = asyncio.Lock()
        self.installed: str | None = None

    async def upgrade(self, version: str, index_url: str | None = None) -> list[str]:
        """Installs `version`; returns the installer's last lines. Then (the
        caller's answer sent first) `on_installed(version)` is called."""
        argv = installer_argv(self.cfg, version, index_url)
        if self._lock.locked() or self.installed is not None:
            raise UpgradeError(409, "Upgrade in progress",
                               "this agent is installing or restarting already")
        async with self._lock:
            logger.info("upgrade to llmgw %s: running %s", version, shown(argv))
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT)
            except OSError as exc:
                raise UpgradeError(422, "Upgrade failed",
                                   f"cannot run the installer {argv[0]!r}: {exc}") from None
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), self.cfg.timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise UpgradeError(422, "Upgrade failed", f"the installer ran past "
                                   f"{self.cfg.timeout:g} s and was killed") from None
            lines = out.decode(errors="replace").splitlines()[-TAIL_LINES:]
            if proc.returncode != 0:
                logger.error("upgrade to llmgw %s failed (exit %s): %s", version,
                             proc.returncode, " | ".join(lines[-5:]))
                raise UpgradeError(422, "Upgrade failed", f"the installer exited with "
                                   f"{proc.returncode}; this agent runs on", lines)
            self.installed = version
        logger.info("llmgw %s installed; restarting on it", version)
        # After the answer is out: the gateway learns the outcome before
        # this agent's API goes away for the restart.
        asyncio.get_running_loop().call_later(0.2, self._on_installed, version)
        return lines
