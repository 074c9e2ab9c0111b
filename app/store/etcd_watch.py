"""`EtcdStore.watch`: the watch loop over etcd's gRPC Watch stream, kept
apart from app/store/etcd.py so each module stays small. It is part of
`EtcdStore` (it reads the store's channel, health and closed flag), not a
public API of its own.

Watches run on our own loop over the gRPC Watch stream, not etcd3aio's
`WatchService.watch`: that one resumes a cut stream from the revision after
the last *response* it saw, "created" included, whose header carries the
current revision rather than the replayed one, so a cut between etcd
accepting a watch from an old revision and sending the replay (up to 100 ms,
etcd's sync interval) would skip the replay silently. Ours resumes from the
revision after the last *event* delivered (or the start revision), so a
reconnect never skips an event: anything not replayable is reported as
`compacted`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc  # type: ignore[import-untyped]  # no type information shipped
from etcd3aio._protobuf import WatchCreateRequest, WatchRequest

from app.store.base import Event, StoreError, StoreUnavailable, WatchBatch
from app.store.etcd_wire import PB_EVENT_DELETE, WATCH_MIN_BACKOFF, WATCH_RETRY_CODES

if TYPE_CHECKING:
    from app.store.etcd import EtcdStore

# The store's logger, not this module's: the watch's records (an outage
# reopening, a compaction resync) kept their logger name when the loop moved
# here, so log settings for "app.store.etcd" still cover them.
logger = logging.getLogger("app.store.etcd")


async def watch(store: EtcdStore, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
    """`EtcdStore.watch`; see `Store.watch`.

    `next_revision` is the only resume point: the start revision until an
    event is delivered, then the last delivered event's revision + 1. It
    never moves on a "created" or progress header, which carry the
    store's current revision, not the stream's position; so a stream cut
    anywhere (even between "created" and a replay of old revisions) is
    reopened from the first revision not yet delivered, and every event
    arrives once, in order. Transient gRPC failures reopen the stream
    with backoff (0.1 s doubling to the store's `watch_max_backoff`); other
    statuses raise StoreError. Created and progress responses are not
    yielded.
    """
    key, range_end = store._range_bounds(prefix)
    next_revision = start_revision
    backoff = WATCH_MIN_BACKOFF
    while not store._closed:
        try:
            services = await store._services()
        except StoreUnavailable as exc:
            store._lost(str(exc))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, store._watch_max_backoff)
            continue
        call = services.watch.Watch()
        compacted = False
        try:
            await call.write(
                WatchRequest(
                    create_request=WatchCreateRequest(
                        key=key, range_end=range_end, start_revision=next_revision
                    )
                )
            )
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    logger.warning("etcd watch stream on %r ended; reopening", prefix)
                    break
                if resp.compact_revision > 0:
                    # etcd cancels a watch it cannot replay and never says
                    # so again. Report it (below), then go on from now.
                    compacted = True
                    break
                if resp.canceled:
                    logger.warning(
                        "etcd cancelled the watch on %r: %s", prefix, resp.cancel_reason
                    )
                    break
                if resp.created:
                    store._health.succeeded()
                    logger.debug(
                        "etcd watch on %r created from revision %d (store at %d)",
                        prefix,
                        next_revision,
                        resp.header.revision,
                    )
                    if next_revision == 0:
                        # "From now" is pinned to the revision it meant, so
                        # a reconnect does not move it on silently.
                        next_revision = int(resp.header.revision) + 1
                    continue
                if not resp.events:
                    continue  # a progress notification: nothing moves
                # The last event's revision, never the header's: a replay
                # comes in several responses, each headed with the
                # current revision. Raw events, so keys we drop count too.
                next_revision = int(resp.events[-1].kv.mod_revision) + 1
                events = [e for pb in resp.events if (e := _event(store, pb)) is not None]
                if events:
                    backoff = WATCH_MIN_BACKOFF
                    yield WatchBatch(events, events[-1].mod_revision)
        except grpc.aio.AioRpcError as exc:
            if store._closed:
                return
            code = exc.code()
            if code not in WATCH_RETRY_CODES:
                raise StoreError(f"etcd watch: {code.name} {exc.details() or ''}") from exc
            store._lost(f"etcd watch: {code.name} {exc.details() or ''}")
            # Debug: the outage itself is logged once, by the health tracker.
            logger.debug(
                "etcd watch on %r failed (%s %s); reopening from revision %d in %.2fs",
                prefix,
                code.name,
                exc.details() or "",
                next_revision,
                backoff,
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling() > 0:
                raise  # our reader was cancelled
            if store._closed:
                return  # close() closed the channel under the call
            # The channel was replaced (the names resolved elsewhere) and
            # its grace period ended: reopen on the new one.
            logger.debug("etcd watch on %r: its channel was closed; reopening", prefix)
        finally:
            call.cancel()
        if store._closed:
            return
        if compacted:
            current = await _current_revision(store)
            if current is None:
                return
            yield WatchBatch([], current, compacted=True)
            next_revision = current + 1
            continue
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, store._watch_max_backoff)


def _event(store: EtcdStore, pb: Any) -> Event | None:
    key = store._relative(pb.kv.key)
    if key is None:
        return None
    kv = pb.kv
    if pb.type == PB_EVENT_DELETE:
        return Event("delete", key, b"", kv.mod_revision)
    return Event("put", key, bytes(kv.value), kv.mod_revision, kv.lease, kv.create_revision)


async def _current_revision(store: EtcdStore) -> int | None:
    """The store's revision, retried until etcd answers; None once closed."""
    delay = 0.25
    while not store._closed:
        try:
            with store._calling("revision"):
                start, _ = store._range_bounds("")
                kv = (await store._services()).kv
                resp = await kv.get(start, count_only=True, timeout=store._timeout)
            return int(resp.header.revision)
        except StoreUnavailable:
            logger.warning("etcd unavailable while resyncing a watch; retrying")
            await asyncio.sleep(delay)
            delay = min(delay * 2, store._watch_max_backoff)
    return None
