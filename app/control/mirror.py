"""A watch-fed copy of the whole store, kept by every gateway.

Everything that serves a request reads this copy, never the store
(DESIGN invariant 2): with etcd unreachable, routing goes on from the last
state seen. The copy is level-based: `resync()` reads the prefix in full and
replaces it; `apply()` folds in one watch batch. A batch that reports a
compaction (the store could not replay what we missed) triggers a resync,
since applying events after a gap would silently lose the ones in between.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from app.control import state as s
from app.store.base import KeyValue, Store, StoreError, StoreUnavailable, WatchBatch

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
Listener = Callable[[set[str]], None]


class Mirror:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._kvs: dict[str, KeyValue] = {}
        self.revision = 0
        self.ready = False
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- feeding -------------------------------------------------------------

    async def resync(self) -> None:
        result = await self._store.range("")
        old = self._kvs
        self._kvs = {kv.key: kv for kv in result.kvs}
        self.revision = result.revision
        self.ready = True
        changed = {k for k in old.keys() | self._kvs.keys() if old.get(k) != self._kvs.get(k)}
        self._notify(changed)
        self._wake()

    def apply(self, batch: WatchBatch) -> bool:
        """Folds one batch in. False means the batch reported a gap: resync."""
        if batch.compacted:
            return False
        changed: set[str] = set()
        for ev in batch.events:
            if ev.mod_revision <= self.revision:
                continue  # already seen (a resync raced the watch)
            if ev.kind == "put":
                self._kvs[ev.key] = KeyValue(
                    ev.key, ev.value, ev.create_revision, ev.mod_revision, ev.lease
                )
            else:
                self._kvs.pop(ev.key, None)
            changed.add(ev.key)
        self.revision = max(self.revision, batch.revision)
        self._notify(changed)
        self._wake()
        return True

    async def run(self) -> None:
        """Keeps the copy current until cancelled; resyncs after any gap."""
        backoff = 0.2
        while True:
            try:
                await self.resync()
                async for batch in self._store.watch("", self.revision + 1):
                    backoff = 0.2
                    if not self.apply(batch):
                        logger.warning("watch reported a gap at revision %d; resyncing",
                                       batch.revision)
                        break
                continue  # a gap: re-read at once
            except StoreUnavailable as exc:
                # Said once by the store itself when it became unreachable
                # (its health() shows on /readyz); not once per retry here.
                logger.debug("mirror lost the store (%s); retrying in %.1f s", exc, backoff)
            except StoreError as exc:
                logger.warning("mirror lost the store (%s); retrying in %.1f s", exc, backoff)
            except Exception:
                # A bug must not leave the router on a copy that never changes.
                logger.exception("mirror crashed; resyncing in %.1f s", backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="mirror")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # --- listening -------------------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        """`listener(changed_keys)` runs in the loop after every change. It must not block."""
        self._listeners.append(listener)

    def _wake(self) -> None:
        # Wake everyone waiting on the revision they saw; later waiters get a
        # fresh event.
        self._changed.set()
        self._changed = asyncio.Event()

    def _notify(self, changed: set[str]) -> None:
        if not changed:
            return
        for listener in self._listeners:
            try:
                listener(changed)
            except Exception:
                logger.exception("mirror listener failed")

    async def wait_past(self, revision: int, timeout: float) -> bool:
        """Waits until the mirror has moved past `revision`; False on timeout.

        Callers pass the revision of the state they last read, so a change
        that lands between their read and this call is not missed: waiting
        on "the next change" instead loses exactly that one.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.revision <= revision:
            left = deadline - loop.time()
            if left <= 0:
                return False
            event = self._changed  # taken with the check above: no await between
            # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns
            # the result of an inner wait that completed as the caller was
            # cancelled, and the cancellation is lost (the reconciler then
            # looped on, and a gateway's stop never ended).
            try:
                async with asyncio.timeout(left):
                    await event.wait()
            except TimeoutError:
                break
        return self.revision > revision

    async def wait_for(self, revision: int, timeout: float) -> bool:
        """Read-your-writes: waits until the mirror has seen `revision`."""
        return await self.wait_past(revision - 1, timeout)

    # --- reading ---------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        return self._kvs.get(key)

    def items(self, prefix: str) -> Iterator[KeyValue]:
        # Sort only the matches: one scan of the keys, not a sort of them all.
        for key in sorted(k for k in self._kvs if k.startswith(prefix)):
            yield self._kvs[key]

    def parsed(self, prefix: str, cls: type[T]) -> dict[str, T]:
        """Values under `prefix` parsed as `cls`, by the key's last part.

        An unreadable value is logged and left out rather than failing every
        reader: one bad write must not stop the fleet.
        """
        out: dict[str, T] = {}
        for kv in self.items(prefix):
            try:
                out[kv.key[len(prefix):]] = cls.model_validate_json(kv.value)
            except ValidationError:
                logger.warning("ignoring unreadable %s", kv.key)
        return out

    def one(self, key: str, cls: type[T]) -> T | None:
        kv = self._kvs.get(key)
        if kv is None:
            return None
        try:
            return cls.model_validate_json(kv.value)
        except ValidationError:
            logger.warning("ignoring unreadable %s", key)
            return None

    # Typed views of the state table in docs/architecture.md.
    def models(self) -> dict[str, s.StoredModel]:
        return self.parsed(s.MODELS, s.StoredModel)

    def nodes(self) -> dict[str, s.NodeInfo]:
        return self.parsed(s.NODES, s.NodeInfo)

    def replicas(self) -> dict[str, s.Replica]:
        return self.parsed(s.REPLICAS, s.Replica)

    def statuses(self) -> dict[str, s.ReplicaStatus]:
        return self.parsed(s.STATUS, s.ReplicaStatus)

    def nodeconfs(self) -> dict[str, s.NodeConf]:
        return self.parsed(s.NODECONF, s.NodeConf)

    def quotas(self) -> dict[str, s.Quota]:
        return self.parsed(s.QUOTAS, s.Quota)

    def client_keys(self) -> dict[str, s.ClientKey]:
        return self.parsed(s.KEYS, s.ClientKey)

    def usages(self) -> dict[str, s.Usage]:
        return self.parsed(s.USAGE, s.Usage)

    def leader(self) -> s.LeaderInfo | None:
        return self.one(s.LEADER, s.LeaderInfo)

