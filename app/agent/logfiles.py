"""The agent's log files: its own, and its engines'; read back and rotated.
(The lines read back are masked by the node API, app/agent/nodeapi.py, with
app/wire/masking.py.)

Engines write their log through a file descriptor they inherited (stdout
and stderr, opened O_APPEND by engines.open_log) and outlive the agent
(docs/design/agent.md, "Agent restarts"), so the agent can neither pipe
their output through itself nor make them reopen a renamed file. Rotation
is therefore copy-then-truncate: the file is copied to NAME.1 (older
copies shift to .2, .3...) and truncated to zero; the engine's next write
lands at the new end, since O_APPEND writes always do. Not guaranteed:
lines written between the copy and the truncation (milliseconds) are lost.

Every file is 0600: an engine may log prompts.
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import os
import shutil
from collections import deque
from collections.abc import Iterable
from pathlib import Path

# Most a log answer holds, whatever `lines` asks: an engine may log whole
# prompts on one line.
MAX_BYTES = 2 * 2**20


def generations(path: Path, keep: int) -> list[Path]:
    """`path` and its rotated copies, newest first."""
    return [path, *(path.with_name(f"{path.name}.{i}") for i in range(1, keep + 1))]


def _tail_one(path: Path, lines: int, budget: int) -> list[str]:
    """The last `lines` lines of one file, reading at most `budget` bytes."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - budget)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    text = data.decode(errors="replace")
    out = text.splitlines()
    if start > 0 and out:
        out = out[1:]  # a partial first line
    return list(deque(out, maxlen=lines))


def tail(path: Path, lines: int, keep: int, max_bytes: int = MAX_BYTES) -> list[str]:
    """The last `lines` lines of a log, reaching into rotated copies when the
    current file holds fewer (just after a rotation)."""
    out: list[str] = []
    budget = max_bytes
    for gen in generations(path, keep):
        if len(out) >= lines or budget <= 0:
            break
        got = _tail_one(gen, lines - len(out), budget)
        budget -= sum(len(line) + 1 for line in got)
        out = got + out
    return out


def oversized(path: Path, max_bytes: int) -> bool:
    try:
        return path.stat().st_size > max_bytes
    except OSError:
        return False


async def rotate_oversized(paths: Iterable[Path], max_bytes: int, keep: int) -> list[Path]:
    """Rotates each of `paths` grown past `max_bytes`, in a thread."""
    big = [p for p in paths if oversized(p, max_bytes)]
    for path in big:
        await asyncio.to_thread(rotate, path, keep)
    return big


def rotate(path: Path, keep: int) -> None:
    """Copy-then-truncate (see the module's doc): NAME -> NAME.1 -> ... ->
    NAME.keep (dropped). Blocking: run in a thread."""
    gens = generations(path, max(1, keep))
    gens[-1].unlink(missing_ok=True)
    for older, newer in zip(reversed(gens[1:]), reversed(gens[:-1]), strict=True):
        if newer != path and newer.exists():
            newer.replace(older)
    fd = os.open(gens[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.truncate(path, 0)


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """RotatingFileHandler whose files are 0600, like the engines' logs."""

    def _open(self):  # type: ignore[no-untyped-def]  # typeshed: TextIOWrapper
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "a", encoding=self.encoding or "utf-8", errors=self.errors)


def file_handler(path: Path, max_bytes: int, keep: int) -> logging.Handler:
    """The agent's own log file (the node API's source "agent")."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    handler = PrivateRotatingFileHandler(path, maxBytes=max_bytes, backupCount=keep,
                                         encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler
