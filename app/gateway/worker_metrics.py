"""`/metrics` under `llmgw serve --workers N`: the gateway's figures, not
one worker's.

The kernel hands a scrape's connection to any worker, and each counts only
the requests it served: a scrape answered by one worker, then the next by
another, would see counters jump back and forth. So each worker writes a
snapshot of its request figures (`RequestMetrics.snapshot()`) to
`DATA_DIR/worker-metrics/I.json` every `interval` and on every scrape, and a
scrape sums the snapshots of all N workers, read then, its own written just
before. Each file only grows (until its worker restarts, which Prometheus
reads as a counter reset), and a later scrape reads files at least as new,
so the sums never go back. Files are replaced by rename (never half
written), read with a size cap and their shape checked (`add`); one that
cannot be read is left out of that scrape and said once. The folder is the
gateway user's own, 0700, and a link in it is neither written through nor
read (app/gateway/private_files.py). docs/design/workers.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from app.gateway import private_files
from app.gateway.request_metrics import RequestMetrics

logger = logging.getLogger(__name__)

MAX_BYTES = 4 << 20  # a snapshot: per model and status code, a few KiB per model
FOLDER = "worker-metrics"


def clear(data_dir: Path) -> None:
    """The supervisor, before it starts workers: the folder made (or
    checked: `private_files.Refused`), no snapshot of an earlier run (with
    more workers, or counts since gone) is summed."""
    with private_files.opened(data_dir / FOLDER) as folder:
        folder.clear()


def _name(i: int) -> str:
    return f"{i}.json"


class WorkerMetrics:
    """Worker `index` of `count`: writes its snapshot, sums everyone's."""

    def __init__(self, metrics: RequestMetrics, data_dir: Path, index: int,
                 count: int) -> None:
        self._metrics = metrics
        self._folder = data_dir / FOLDER
        self._index = index
        self._count = count
        self._unreadable: set[int] = set()
        self._last = b""

    def _path(self, i: int) -> Path:
        return self._folder / _name(i)

    def write(self, snap: dict[str, Any]) -> None:
        """This worker's snapshot (taken on the event loop, where it is
        counted), replaced whole (blocking: in a thread)."""
        data = json.dumps(snap, separators=(",", ":")).encode()
        if data == self._last:
            return
        with private_files.opened(self._folder) as folder:
            folder.write(_name(self._index), data)
        self._last = data

    def totals(self, snap: dict[str, Any]) -> RequestMetrics:
        """Every worker's snapshot summed, this one's (`snap`) written first
        (blocking: in a thread). Its own figures are `snap`'s, whether or not
        its file could be written."""
        with contextlib.suppress(OSError):  # said by `run`, every interval
            self.write(snap)
        total = RequestMetrics()
        total.add(snap)
        try:
            with private_files.opened(self._folder, create=False) as folder:
                for i in range(self._count):
                    if i != self._index:
                        self._add(total, folder, i)
        except FileNotFoundError:
            pass  # no worker has written yet
        except OSError as exc:  # the folder refused: the others left out
            for i in range(self._count):
                if i != self._index:
                    self._said(i, f"cannot be read: {exc.strerror or exc}")
        return total

    def _add(self, total: RequestMetrics, folder: private_files.Folder, i: int) -> None:
        """Worker i's snapshot added to `total`, if it is one."""
        try:
            raw = folder.read(_name(i), MAX_BYTES)
        except FileNotFoundError:
            return  # not started yet, or nothing counted
        except OSError as exc:
            self._said(i, f"cannot be read: {exc.strerror or exc}")
            return
        try:
            ok = len(raw) <= MAX_BYTES and total.add(json.loads(raw))
        except ValueError:
            ok = False
        if not ok:
            self._said(i, "is not a snapshot of request figures")
            return
        self._unreadable.discard(i)

    def _said(self, i: int, why: str) -> None:
        if i not in self._unreadable:
            logger.warning("worker %d's metrics file %s %s: left out of /metrics", i,
                           self._path(i), why)
        self._unreadable.add(i)

    async def run(self, interval: float) -> None:
        while True:
            try:
                await asyncio.to_thread(self.write, self._metrics.snapshot())
            except OSError as exc:
                logger.warning("worker metrics not written: %s", exc.strerror or exc)
            await asyncio.sleep(interval)
