"""The leader compacts the store's history, as kube-apiserver compacts etcd.

etcd keeps every revision of every key until told to forget them: node
heartbeats, status reports, usage snapshots and key usage would add history
until etcd's space quota (`--quota-backend-bytes`, 2 GiB by default) raised
its NOSPACE alarm and turned the whole fleet read-only. So every
`interval` seconds the leader compacts to the revision it saw one interval
earlier (docs/design/security-operations.md, "A month of uptime").

Why one interval back, not now: a watch that lags less than one interval
(a gateway's mirror, an agent's long poll behind it) never asks for a
compacted revision; one that lags more gets `compacted` and its mirror
resyncs with a full read, which it already does after an etcd outage. Why
the leader only: compaction is store-wide, and one caller is enough; a
gateway that wrongly believes it leads (paused past its TTL) at worst
compacts to a revision one interval old, which harms no one, so this step
is not fenced. A new leader first notes a revision and compacts one
interval later: it cannot know what its predecessor noted.

What is not bounded by this: etcd's database file does not shrink after a
compaction (the freed pages are reused for new writes); `etcdctl defrag`
gives them back to the file system.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from app.store.base import Store, StoreError

logger = logging.getLogger(__name__)


class Compactor:
    """`step()` is one pass; `run()` repeats it every `interval` seconds.

    `leading` says whether this gateway leads now; `revision` is the store
    revision this gateway has seen (its mirror's: 0 while not loaded). An
    `interval` of 0 turns compaction off.
    """

    def __init__(
        self,
        store: Store,
        leading: Callable[[], bool],
        revision: Callable[[], int],
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._leading = leading
        self._revision = revision
        self._interval = interval
        self._clock = clock
        # The revision noted at the previous pass, and when: the next
        # compaction's target.
        self._mark: tuple[float, int] | None = None
        self.compacted = 0  # the last revision compacted to by this gateway

    async def step(self) -> int:
        """Compacts to the revision noted at least one interval ago, then
        notes the current one. Returns the revision compacted to (0: none).
        Raises StoreError when the store refused or could not be reached;
        the next pass compacts to a newer revision."""
        if self._interval <= 0 or not self._leading():
            self._mark = None  # a leader again later starts afresh
            return 0
        now, current = self._clock(), self._revision()
        if self._mark is None:
            if current > 0:
                self._mark = (now, current)
            return 0
        noted_at, target = self._mark
        if now - noted_at < self._interval:
            return 0
        self._mark = (now, current)
        if target <= self.compacted:
            return 0
        await self._store.compact(target)
        self.compacted = target
        logger.info("compacted the store's history before revision %d", target)
        return target

    async def run(self) -> None:
        """Passes four times per interval: a sleep that wakes a hair early
        must not put a compaction off by a whole interval."""
        if self._interval <= 0:
            return
        while True:
            try:
                await self.step()
            except StoreError as exc:
                logger.warning("compaction failed (%s); retried in %.0f s", exc,
                               self._interval)
            except Exception:
                logger.exception("compaction crashed; retried in %.0f s", self._interval)
            await asyncio.sleep(self._interval / 4)
