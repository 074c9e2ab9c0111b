"""`Watcher`: `EtcdStore.watch`, a loop of our own over etcd's gRPC Watch
stream that survives reconnects and never skips an event.

Why not etcd3aio's `WatchService.watch`: that one resumes a cut stream from
the revision after the last *response* it saw, "created" included, whose
header carries the current revision rather than the replayed one, so a cut
between etcd accepting a watch from an old revision and sending the replay
(up to 100 ms, etcd's sync interval) would skip the replay silently. Ours
resumes from the revision after the last *event* delivered (or the start
revision), so a reconnect never skips an event: anything not replayable is
reported as `compacted`.

One watch runs in stages: get the channel's services (or wait out an
outage), open a stream from the resume point (`_request`), read it into
batches (`_next`: "created" and progress responses move nothing), and when
the stream ends, either report a compaction and go on from the current
revision (`_resynced`) or reopen after a backoff. Its position and backoff
are a `_Position`, one per watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc  # type: ignore[import-untyped]  # no type information shipped
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest

from app.store.base import StoreError, StoreUnavailable, WatchBatch
from app.store.etcd.channel import Services
from app.store.etcd.connection import EtcdConnection
from app.store.etcd.errors import WATCH_RETRY_CODES
from app.store.etcd.keyspace import KeySpace

logger = logging.getLogger(__name__)

# The first wait before reopening a failed stream; doubled each time up to
# the watcher's `max_backoff`, and back to this once events flow again.
WATCH_MIN_BACKOFF = 0.1


class _Ended(enum.Enum):
    """Why a stream ended without an error: reopen from the resume point, or
    etcd could not replay from it (report `compacted`, go on from now)."""

    REOPEN = enum.auto()
    COMPACTED = enum.auto()


class _Position:
    """Where one watch resumes, and how long it waits before reopening.

    `next_revision` is the only resume point: the start revision until an
    event is delivered, then the last delivered event's revision + 1. It
    never moves on a "created" or progress header, which carry the store's
    current revision, not the stream's position.
    """

    def __init__(self, prefix: str, start_revision: int, max_backoff: float) -> None:
        self.prefix = prefix
        self.next_revision = start_revision
        self.backoff = WATCH_MIN_BACKOFF
        self._max_backoff = max_backoff

    async def wait(self) -> None:
        await asyncio.sleep(self.backoff)
        self.backoff = min(self.backoff * 2, self._max_backoff)


class Watcher:
    """Watches on one store's connection and key space.

    `max_backoff` caps the wait between reopenings (it starts at 0.1 s).
    """

    def __init__(self, connection: EtcdConnection, keys: KeySpace, max_backoff: float) -> None:
        self._connection = connection
        self._keys = keys
        self._max_backoff = max_backoff

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        """See `Store.watch`.

        A stream cut anywhere (even between "created" and a replay of old
        revisions) is reopened from the first revision not yet delivered,
        so every event arrives once, in order. Transient gRPC failures
        reopen the stream with backoff; other statuses raise StoreError.
        Created and progress responses are not yielded.
        """
        position = _Position(prefix, start_revision, self._max_backoff)
        while not self._connection.closed:
            services = await self._services(position)
            if services is None:
                continue
            call = services.watch.Watch()
            ended = _Ended.REOPEN  # also what a transient failure leads to
            try:
                with self._reopening(position):
                    await self._request(call, position)
                    while True:
                        got = await self._next(call, position)
                        if isinstance(got, _Ended):
                            ended = got
                            break
                        yield got
            finally:
                call.cancel()
            if self._connection.closed:
                return
            if ended is _Ended.COMPACTED:
                current = await self._resynced()
                if current is None:
                    return
                yield WatchBatch([], current, compacted=True)
                position.next_revision = current + 1
                continue
            await position.wait()

    async def _services(self, position: _Position) -> Services | None:
        """The channel's services; None after waiting out an outage."""
        try:
            return await self._connection.services()
        except StoreUnavailable as exc:
            self._connection.lost(str(exc))
            await position.wait()
            return None

    async def _request(self, call: Any, position: _Position) -> None:
        """Asks etcd for the watch, from the resume point on."""
        key, range_end = self._keys.bounds(position.prefix)
        create = WatchCreateRequest(
            key=key, range_end=range_end, start_revision=position.next_revision)
        await call.write(WatchRequest(create_request=create))

    async def _next(self, call: Any, position: _Position) -> WatchBatch | _Ended:
        """The stream's next batch of events, or why it ended."""
        while True:
            resp = await call.read()
            if resp is grpc.aio.EOF:
                logger.warning("etcd watch stream on %r ended; reopening", position.prefix)
                return _Ended.REOPEN
            if resp.compact_revision > 0:
                # etcd cancels a watch it cannot replay and never says so
                # again. Reported by the caller, which then goes on from now.
                return _Ended.COMPACTED
            if resp.canceled:
                logger.warning("etcd cancelled the watch on %r: %s", position.prefix,
                               resp.cancel_reason)
                return _Ended.REOPEN
            if resp.created:
                self._created(resp, position)
                continue
            batch = self._batch(resp, position)
            if batch is not None:
                return batch

    def _created(self, resp: Any, position: _Position) -> None:
        self._connection.reached()
        logger.debug("etcd watch on %r created from revision %d (store at %d)",
                     position.prefix, position.next_revision, resp.header.revision)
        if position.next_revision == 0:
            # "From now" is pinned to the revision it meant, so a reconnect
            # does not move it on silently.
            position.next_revision = int(resp.header.revision) + 1

    def _batch(self, resp: Any, position: _Position) -> WatchBatch | None:
        """The response's events under our prefix; None for a progress
        notification or events all outside it."""
        if not resp.events:
            return None  # a progress notification: nothing moves
        # The last event's revision, never the header's: a replay comes in
        # several responses, each headed with the current revision. Raw
        # events, so keys we drop count too.
        position.next_revision = int(resp.events[-1].kv.mod_revision) + 1
        events = [e for pb in resp.events if (e := self._keys.event(pb)) is not None]
        if not events:
            return None
        position.backoff = WATCH_MIN_BACKOFF
        return WatchBatch(events, events[-1].mod_revision)

    @contextlib.contextmanager
    def _reopening(self, position: _Position) -> Iterator[None]:
        """Lets a stream's transient failure end it, to be reopened; raises
        StoreError for any other status. Quiet once the store is closed."""
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            if self._connection.closed:
                return
            code, detail = exc.code(), exc.details() or ""
            if code not in WATCH_RETRY_CODES:
                raise StoreError(f"etcd watch: {code.name} {detail}") from exc
            self._connection.lost(f"etcd watch: {code.name} {detail}")
            # Debug: the outage itself is logged once, by the health tracker.
            logger.debug("etcd watch on %r failed (%s %s); reopening from revision %d in %.2fs",
                         position.prefix, code.name, detail, position.next_revision,
                         position.backoff)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling() > 0:
                raise  # our reader was cancelled
            if self._connection.closed:
                return  # close() closed the channel under the call
            # The channel was replaced (the names resolved elsewhere) and its
            # grace period ended: reopen on the new one.
            logger.debug("etcd watch on %r: its channel was closed; reopening", position.prefix)

    async def _resynced(self) -> int | None:
        """The store's revision, retried until etcd answers; None once closed."""
        delay = 0.25
        start, _ = self._keys.bounds("")
        while not self._connection.closed:
            try:
                with self._connection.calling("revision"):
                    kv = (await self._connection.services()).kv
                    resp = await kv.get(start, count_only=True, timeout=self._connection.timeout)
                return int(resp.header.revision)
            except StoreUnavailable:
                logger.warning("etcd unavailable while resyncing a watch; retrying")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_backoff)
        return None
