"""The agent's self-upgrade: install one llmgw wheel, then run it.

`POST /node/v1/upgrade {"version": "X", "sha256": "..."}` (nodeapi.py)
installs llmgw X into the agent's own interpreter's environment, and only
from where this node's operator said upgrades come from:
`LLMGW_AGENT_UPGRADE_SOURCE`, a package index URL or a local wheel
directory. None is set by default, and then every upgrade is refused: the
name `llmgw` on a public index is anyone's to publish, and whatever is
installed runs as the agent's user on a GPU node. The request names the
wheel's sha256, and only that file is installed: pip downloads the wheel
alone (`--no-deps --only-binary=:all:`, so no sdist's build code runs) into
a temporary folder, the agent hashes it, and installs that file with
`--no-index`. The gateway refuses versions outside its agent version window
(app/control/placement/agentversion.py) before asking.

Index credentials (`https://user:pass@host/simple`, or a netrc) reach pip
through its environment (`PIP_INDEX_URL`), never its command line, which
every local user can read in /proc.

It waits for the installer (up to `timeout` s each step; the gateway waits
that long plus a margin, app/api/nodes.py). On success it answers 200 and,
once the answer is out, asks the agent to stop cleanly (engines left
running, their records saved) and re-execute itself: `reexec_argv()` runs
the same command line through `python -m app.cli`. That imports the
installed package only where `app` comes from the environment pip installs
into: `code_origin_problem()` refuses an upgrade up front where it would
not (a checkout, the image's copied sources, an editable install). On
failure the agent keeps running and answers 422 with the installer's last
lines. One upgrade at a time: a second while one runs answers 409.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from app.agent.codeorigin import code_origin_problem

logger = logging.getLogger(__name__)

SOURCE_SETTING = "LLMGW_AGENT_UPGRADE_SOURCE"
# PEP 440-ish: digits, dots, letters for pre/post/dev/local parts; nothing
# that pip would read as another argument.
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_URL = re.compile(r"^https?://[^\s]{1,2000}$")
_USERINFO = re.compile(r"(://)[^/@\s]+@")
# pip settings that name where packages come from: the node's source
# replaces them in the installer's environment, so nothing else is asked.
_SOURCE_VARS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX")
TAIL_LINES = 20


class UpgradeError(Exception):
    """Refused or failed; `status` is the HTTP status to answer."""

    def __init__(self, status: int, title: str, detail: str, output: list[str] | None = None,
                 ) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail
        self.output = output or []


@dataclass(frozen=True)
class Source:
    """Where this node takes llmgw wheels from: `index` (a URL, its
    credentials included) or `folder` (a local wheel directory)."""

    index: str = ""
    folder: str = ""

    def env(self) -> dict[str, str]:
        """The pip settings that make it the only source."""
        if self.index:
            return {"PIP_INDEX_URL": self.index}
        return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": self.folder}

    def __str__(self) -> str:
        return mask(self.index) if self.index else self.folder


def parse_source(raw: str) -> Source | None:
    """LLMGW_AGENT_UPGRADE_SOURCE: "" none; an http(s) index URL; an
    absolute path to a folder of wheels. ValueError naming the setting."""
    raw = raw.strip()
    if not raw:
        return None
    if _URL.match(raw):
        return Source(index=raw)
    if raw.startswith("/") and "\x00" not in raw:
        return Source(folder=os.path.normpath(raw))
    raise ValueError(f"{SOURCE_SETTING}: {mask(raw)!r} is neither an http(s):// package index "
                     "URL nor an absolute path to a folder of wheels")


@dataclass
class UpgradeConfig:
    # Where upgrades come from (LLMGW_AGENT_UPGRADE_SOURCE); None: refused.
    source: Source | None = None
    # Seconds each pip run may take; then it is killed and the upgrade fails.
    timeout: float = 300.0
    # The interpreter whose environment pip installs into: the agent's own.
    python: str = sys.executable
    # Checks that the re-executed agent would import what pip installs;
    # None: this process's own (codeorigin.py). Tests inject another.
    origin_problem: Callable[[], str | None] | None = None


def check_request(version: str, sha256: str) -> None:
    if not _VERSION.match(version):
        raise UpgradeError(400, "Bad version", f"{version!r} is not a version (e.g. 0.2.0)")
    if not _SHA256.match(sha256):
        raise UpgradeError(400, "Bad sha256", "send the wheel's sha256: 64 lowercase hex "
                           "digits (`sha256sum llmgw-X-py3-none-any.whl`)")


def mask(text: str) -> str:
    """`text` with a URL's credentials masked (DESIGN invariant 6 in
    docs/architecture.md: secrets never in logs or answers)."""
    return _USERINFO.sub(r"\1***@", text)


def reexec_argv(argv: list[str], python: str = sys.executable) -> list[str]:
    """The command line that runs this agent again on the installed code:
    `argv` is sys.argv (its [0] the console script or app/cli.py), the rest
    are the agent's own arguments, kept as they were."""
    return [python, "-m", "app.cli", *argv[1:]]


def pip_env(source: Source, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in _SOURCE_VARS}
    return env | source.env() | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Upgrader:
    def __init__(self, cfg: UpgradeConfig, on_installed: Callable[[str], None]) -> None:
        self.cfg = cfg
        self._on_installed = on_installed
        self._lock = asyncio.Lock()
        self.installed: str | None = None

    def refusal(self) -> UpgradeError | None:
        """Why this agent cannot upgrade at all, before any request is read."""
        if self.cfg.source is None:
            return UpgradeError(409, "Upgrades not enabled on this node", f"{SOURCE_SETTING} is "
                                "not set on this node: its operator chooses where upgrades come "
                                "from (a package index URL or a folder of wheels)")
        why = (self.cfg.origin_problem or code_origin_problem)()
        if why is not None:
            return UpgradeError(409, "Upgrade would not take effect", why)
        return None

    async def upgrade(self, version: str, sha256: str) -> list[str]:
        """Installs llmgw `version`, the wheel of that `sha256` from the
        node's source; returns pip's last lines. Then (the caller's answer
        sent first) `on_installed(version)` is called."""
        check_request(version, sha256)
        if self._lock.locked() or self.installed is not None:
            raise UpgradeError(409, "Upgrade in progress",
                               "this agent is installing or restarting already")
        async with self._lock:
            refused = await asyncio.to_thread(self.refusal)  # stats the search path
            if refused is not None:
                raise refused
            assert self.cfg.source is not None
            logger.info("upgrade to llmgw %s (sha256 %s) from %s", version, sha256,
                        self.cfg.source)
            with tempfile.TemporaryDirectory(prefix="llmgw-upgrade-") as tmp:
                wheel = await self._fetch(version, sha256, Path(tmp))
                lines = await self._pip(version, ["install", "--no-deps", "--no-index",
                                                  "--no-input", str(wheel)])
            self.installed = version
        logger.info("llmgw %s installed; restarting on it", version)
        # After the answer is out: the gateway learns the outcome before
        # this agent's API goes away for the restart.
        asyncio.get_running_loop().call_later(0.2, self._on_installed, version)
        return lines

    async def _fetch(self, version: str, sha256: str, dest: Path) -> Path:
        await self._pip(version, ["download", "--no-deps", "--only-binary=:all:", "--no-input",
                                  "--dest", str(dest), f"llmgw=={version}"])
        files = await asyncio.to_thread(lambda: sorted(dest.iterdir()))
        if len(files) != 1 or not files[0].name.endswith(".whl"):
            raise UpgradeError(422, "Upgrade failed", f"the source gave {len(files)} files for "
                               f"llmgw {version}, not one wheel; nothing installed")
        got = await asyncio.to_thread(sha256_of, files[0])
        if got != sha256:
            logger.error("upgrade to llmgw %s refused: %s has sha256 %s, not %s", version,
                         files[0].name, got, sha256)
            raise UpgradeError(422, "Wheel refused", f"{files[0].name} from {self.cfg.source} "
                               f"has sha256 {got}, not {sha256}; nothing installed")
        return files[0]

    async def _pip(self, version: str, args: list[str]) -> list[str]:
        assert self.cfg.source is not None
        argv = [self.cfg.python, "-m", "pip", *args]
        logger.info("upgrade to llmgw %s: running %s", version, shlex.join(argv))
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=pip_env(self.cfg.source))
        except OSError as exc:
            raise UpgradeError(422, "Upgrade failed",
                               f"cannot run {argv[0]!r}: {exc}") from None
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.cfg.timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise UpgradeError(422, "Upgrade failed", f"pip {args[0]} ran past "
                               f"{self.cfg.timeout:g} s and was killed") from None
        lines = [mask(x) for x in out.decode(errors="replace").splitlines()[-TAIL_LINES:]]
        if proc.returncode != 0:
            logger.error("upgrade to llmgw %s failed: pip %s exited %s: %s", version, args[0],
                         proc.returncode, " | ".join(lines[-5:]))
            raise UpgradeError(422, "Upgrade failed", f"pip {args[0]} exited with "
                               f"{proc.returncode}; this agent runs on", lines)
        return lines
