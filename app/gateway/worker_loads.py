"""The engine-load poll under `llmgw serve --workers N`: split among the
gateway's workers, not repeated by each (docs/design/workers.md).

Every worker routes by every engine's figures, and a poll round costs about
0.15 ms of CPU a node (app/router/engine_load.py): were each worker to ask
every node, N workers would ask each node N times a round, at 10,000 nodes
and 16 workers some 5 cores of the gateway's machine. So worker I asks only
the nodes whose name hashes (CRC-32) to I modulo N, writes its figures to
`DATA_DIR/worker-loads/I.json` once a round (replaced by rename, never half
written), and reads the others' files when they change (checked each slice
of its round). A figure keeps the time it was read (CLOCK_MONOTONIC, one
clock for every process of the machine), so the route table's staleness
bound holds for the others' figures as for its own: a dead worker's file
stops changing and its figures go stale, then unknown, until it is back.

A file is read up to `MAX_BYTES`, and taken only in its shape (each figure
four finite numbers, counts not negative, the KV cache's use within 0..1,
read no later than now); one that is not is left out and said once. The
folder is the gateway user's own, 0700, and a link in it is neither written
through nor read (app/gateway/private_files.py). Blocking: each call runs
in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from app.gateway import private_files
from app.router.choice import EngineLoad

logger = logging.getLogger(__name__)

FOLDER = "worker-loads"
# A figure is ~60 bytes: 64 MiB is a million replicas.
MAX_BYTES = 64 << 20


def clear(data_dir: Path) -> None:
    """The supervisor, before it starts workers: the folder made (or
    checked: `private_files.Refused`), no figure of an earlier run is read
    (after a reboot its times could even look fresh)."""
    with private_files.opened(data_dir / FOLDER) as folder:
        folder.clear()


def _figure(v: Any, now: float) -> EngineLoad | None:
    if not isinstance(v, list) or len(v) != 4:
        return None
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
               for x in v):
        return None
    running, waiting, kv, at = v
    if running < 0 or waiting < 0 or not 0 <= kv <= 1 or at > now + 1.0:
        return None
    return EngineLoad(float(running), float(waiting), float(kv), float(at))


def _name(i: int) -> str:
    return f"{i}.json"


class WorkerLoads:
    """Worker `index` of `count`'s part of the poll (app/router/engine_load.py's
    `LoadShare`)."""

    def __init__(self, data_dir: Path, index: int, count: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._folder = data_dir / FOLDER
        self._index = index
        self._count = count
        self._clock = clock
        # Per other worker: (mtime_ns, size) of its file when read, its figures.
        self._read: dict[int, tuple[tuple[int, int], dict[str, EngineLoad]]] = {}
        self._unreadable: set[int] = set()

    def _path(self, i: int) -> Path:
        return self._folder / _name(i)

    def mine(self, node: str) -> bool:
        return zlib.crc32(node.encode()) % self._count == self._index

    async def publish(self, own: Mapping[str, EngineLoad]) -> None:
        try:
            await asyncio.to_thread(self.write, dict(own))
        except OSError as exc:
            logger.warning("engine loads not written for the other workers: %s",
                           exc.strerror or exc)

    async def others(self) -> dict[str, EngineLoad] | None:
        return await asyncio.to_thread(self.read)

    def write(self, own: Mapping[str, EngineLoad]) -> None:
        data = json.dumps({"loads": {rid: list(f) for rid, f in own.items()}},
                          separators=(",", ":")).encode()
        with private_files.opened(self._folder) as folder:
            folder.write(_name(self._index), data)

    def read(self) -> dict[str, EngineLoad] | None:
        """Every other worker's figures, its file read again only if it
        changed; None when none did."""
        changed = False
        try:
            with private_files.opened(self._folder, create=False) as folder:
                for i in range(self._count):
                    if i != self._index:
                        changed |= self._read_one(folder, i)
        except OSError as exc:  # no folder yet, or one refused: no figure of theirs
            for i in range(self._count):
                if i == self._index:
                    continue
                if not isinstance(exc, FileNotFoundError):
                    self._said(i, f"cannot be read: {exc.strerror or exc}")
                changed |= self._read.pop(i, None) is not None
        if not changed:
            return None
        out: dict[str, EngineLoad] = {}
        for _, figures in self._read.values():
            out.update(figures)
        return out

    def _read_one(self, folder: private_files.Folder, i: int) -> bool:
        """Worker i's figures read again if its file changed: whether they did."""
        try:
            st = folder.lstat(_name(i))
        except FileNotFoundError:
            return self._read.pop(i, None) is not None
        except OSError as exc:
            self._said(i, f"cannot be read: {exc.strerror or exc}")
            return False
        seen = (st.st_mtime_ns, st.st_size)
        if i in self._read and self._read[i][0] == seen:
            return False
        figures = self._load(folder, i)
        self._read[i] = (seen, figures if figures is not None else {})
        return True

    def _load(self, folder: private_files.Folder, i: int) -> dict[str, EngineLoad] | None:
        try:
            raw = folder.read(_name(i), MAX_BYTES)
        except OSError as exc:
            self._said(i, f"cannot be read: {exc.strerror or exc}")
            return None
        try:
            doc = json.loads(raw) if len(raw) <= MAX_BYTES else None
        except ValueError:
            doc = None
        loads = doc.get("loads") if isinstance(doc, dict) else None
        if not isinstance(loads, dict):
            self._said(i, "is not a worker's engine loads")
            return None
        now = self._clock()
        out: dict[str, EngineLoad] = {}
        for rid, v in loads.items():
            fig = _figure(v, now)
            if fig is None:
                self._said(i, f"holds a figure out of shape (replica {str(rid)[:80]!r})")
                return None
            out[rid] = fig
        self._unreadable.discard(i)
        return out

    def _said(self, i: int, why: str) -> None:
        if i not in self._unreadable:
            logger.warning("worker %d's engine loads file %s %s: left out", i,
                           self._path(i), why)
        self._unreadable.add(i)
