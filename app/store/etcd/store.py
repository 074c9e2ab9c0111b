"""`EtcdStore`: the store contract (app/store/base.py) over etcd v3, with
etcd3aio's services on a channel of our own.

The store is three parts, each in its module: the connection
(connection.py: the channel, typed errors, health), the key space
(keyspace.py: keys under LLMGW_ETCD_PREFIX, etcd's messages) and the watcher
(watcher.py: `watch`). This module holds the calls themselves: reads, writes,
transactions and leases, each one bounded by `timeout` and translated by
`EtcdConnection.calling` into `LeaseExpired`, `StoreError`, `StoreFull` or
`StoreUnavailable` (app/store/etcd/errors.py says which is which).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc  # type: ignore[import-untyped]  # no type information shipped
from etcd3aio import SortOrder, SortTarget
from etcd3aio._protobuf import LeaseKeepAliveRequest

from app.store.base import (
    Compare,
    KeyValue,
    LeaseExpired,
    Op,
    Put,
    RangeResult,
    StoreError,
    StoreHealth,
    StoreUnavailable,
    TxnResult,
    WatchBatch,
)
from app.store.etcd.channel import Resolver, Services, getaddrinfo
from app.store.etcd.connection import EtcdConnection
from app.store.etcd.endpoints import parse_endpoints
from app.store.etcd.errors import COMPACTED_DETAIL
from app.store.etcd.keyspace import KeySpace
from app.store.etcd.tls import EtcdTls
from app.store.etcd.watcher import Watcher

# etcd's AlarmType.NOSPACE in an alarm list (0 is none, 2 corrupt).
NOSPACE_ALARM = 1


class _Renewals:
    """One LeaseKeepAlive stream on one channel's services, kept open from
    one renewal to the next: a renewal is one request written and one answer
    read. Opening a stream per renewal (an HTTP/2 stream, gRPC's call and
    the task that feeds its requests, then its cancellation) was the largest
    of an idle gateway's costs, twice a second (docs/design/store.md, "etcd
    client"). A stream that fails or runs late is dropped and never read
    again: an answer it owes cannot be taken for the next renewal's."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.call = services.renewals.LeaseKeepAlive()  # requests by write()

    async def renew(self, lease: int) -> int | None:
        """The lease's TTL as etcd answers (0: gone); None if the stream
        ended. Unbounded: the caller times it."""
        if self.call.done():
            return None
        await self.call.write(LeaseKeepAliveRequest(ID=lease))
        resp = await self.call.read()
        if resp is grpc.aio.EOF:
            return None
        if int(resp.ID) != lease:
            raise StoreUnavailable(f"etcd keepalive: answered for lease {int(resp.ID):x}, "
                                   f"not {lease:x}")
        return int(resp.TTL)

    def close(self) -> None:
        self.call.cancel()


class EtcdStore:
    """The `Store` contract on etcd. No I/O until `connect()`; `open()` does both.

    `timeout` bounds each call, retries included, so a dead etcd costs a caller
    at most that long before `StoreUnavailable`. A larger value rides out an
    etcd leader election (about 1 s on loopback, longer across hosts) without
    an error; a smaller one fails writes faster when etcd is gone.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        timeout: float = 5.0,
        *,
        watch_max_backoff: float = 2.0,
        resolver: Resolver = getaddrinfo,
        resolve_interval: float = 1.0,
        page_size: int = 1000,
        tls: EtcdTls | None = None,
    ) -> None:
        # Bad input stops the gateway at start, naming the endpoint.
        parsed = parse_endpoints(endpoints)
        # https endpoints: verified against `tls.ca` (None: the system's
        # CAs). TLS files with plain endpoints would be silently unused.
        if parsed[0].tls:
            tls = tls or EtcdTls()
        elif tls is not None:
            raise ValueError("etcd TLS files are set but the etcd endpoints are not "
                             "https://; write them as https://host:port")
        self._keys = KeySpace(prefix)
        self._timeout = timeout
        # Keys per Range page (`range`): 1000 keys fit the client's 4 MiB
        # message cap while they average under 4 KiB; ours (replicas,
        # statuses, nodes) are a few hundred bytes each.
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, not {page_size}")
        self._page_size = page_size
        self._connection = EtcdConnection(parsed, timeout, resolver, resolve_interval, tls)
        # Cap of the watch's reconnect backoff (it starts at 0.1 s). A watch
        # that feeds the router should notice a restarted etcd soon; lower
        # costs only a few more connection attempts while etcd is down.
        self._watcher = Watcher(self._connection, self._keys, watch_max_backoff)
        # The lease renewals' stream, while it serves; one renewal at a time.
        self._renewals: _Renewals | None = None
        self._renewing = asyncio.Lock()

    @classmethod
    async def open(cls, endpoints: Sequence[str], prefix: str, timeout: float = 5.0,
                   tls: EtcdTls | None = None) -> EtcdStore:
        store = cls(endpoints, prefix, timeout, tls=tls)
        await store.connect()
        return store

    async def connect(self) -> None:
        """See `EtcdConnection.open`: a down etcd is reported by the first
        call, not here, so a gateway can start while etcd restarts."""
        self._connection.open()

    async def close(self) -> None:
        self._drop_renewals()
        await self._connection.close()

    def health(self) -> StoreHealth:
        return self._connection.health()

    async def _services(self) -> Services:
        """Where every call of this class gets the channel's services (one
        per call, one per page of a range)."""
        return await self._connection.services()

    # -- reads and writes -----------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        with self._connection.calling("get"):
            kv = (await self._services()).kv
            resp = await kv.get(self._keys.full(key), timeout=self._timeout)
        return self._keys.key_value(resp.kvs[0]) if resp.kvs else None

    async def range(self, prefix: str) -> RangeResult:
        """Every key under `prefix`, read in pages of `page_size` keys.

        One unbounded Range answers in one gRPC message, and the client
        refuses a message over 4 MiB: a large fleet's state (thousands of
        replicas, statuses, nodes) would fail to load at all. Each page
        continues from the last key read + a zero byte (the next possible
        key), and every page after the first is read at the first one's
        revision, so the pages form one consistent snapshot (a resync must
        not mix two states: docs/design/scale.md). If that revision
        is compacted meanwhile, etcd refuses the read (StoreError) and the
        caller reads again from the start.
        """
        start, end = self._keys.bounds(prefix)
        kvs: list[KeyValue] = []
        revision = 0
        while True:
            with self._connection.calling("range"):
                kv = (await self._services()).kv
                resp = await kv.get(
                    start,
                    range_end=end,
                    revision=revision,
                    limit=self._page_size,
                    sort_order=SortOrder.ASCEND,
                    sort_target=SortTarget.KEY,
                    timeout=self._timeout,
                )
            if revision == 0:
                revision = int(resp.header.revision)
            kvs += [kv for kv in map(self._keys.key_value, resp.kvs) if kv is not None]
            if not resp.more or not resp.kvs:
                return RangeResult(kvs, revision)
            start = bytes(resp.kvs[-1].key) + b"\x00"

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        with self._connection.calling("put", write=True):
            kv = (await self._services()).kv
            resp = await kv.put(self._keys.full(key), value, lease=lease, timeout=self._timeout)
        return int(resp.header.revision)

    async def delete(self, key: str) -> bool:
        with self._connection.calling("delete"):
            kv = (await self._services()).kv
            resp = await kv.delete(self._keys.full(key), timeout=self._timeout)
        return bool(resp.deleted > 0)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        pb_compares = [self._keys.compare(c) for c in compares]
        # etcd refuses any transaction holding a put under NOSPACE, whichever
        # branch runs; one accepted proves the space back.
        writes = any(isinstance(op, Put) for op in (*success, *failure))
        with self._connection.calling("txn", write=writes):
            kv = (await self._services()).kv
            resp = await kv.txn(
                pb_compares,
                [self._keys.op(op) for op in success],
                [self._keys.op(op) for op in failure],
                timeout=self._timeout,
            )
        return TxnResult(bool(resp.succeeded), int(resp.header.revision))

    # -- leases ---------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        with self._connection.calling("grant", write=True):
            leases = (await self._services()).lease
            resp = await leases.grant(ttl, timeout=self._timeout)
        if resp.error:
            raise StoreError(f"etcd grant: {resp.error}")
        return int(resp.ID)

    async def keepalive(self, lease: int) -> int:
        """One keepalive, on the stream the last one left open (`_Renewals`;
        a new one after a failure or on a new channel). No background task:
        the caller (the leader election) paces renewals and times the last
        success itself, because a client-side "alive" flag stays true while
        etcd is down."""
        with self._connection.calling("keepalive"):
            # One deadline for the turn on the stream and the renewal itself:
            # renewals at once (the election's, a node's) each end within it,
            # not one timeout after another.
            async with asyncio.timeout(self._timeout), self._renewing:
                services = await self._services()
                if self._renewals is None or self._renewals.services is not services:
                    self._drop_renewals()
                    self._renewals = _Renewals(services)
                try:
                    ttl = await self._renewals.renew(lease)
                except BaseException:
                    self._drop_renewals()
                    raise
                if ttl is None:
                    self._drop_renewals()
                    raise StoreUnavailable("etcd keepalive: stream closed without an answer")
        if ttl <= 0:
            # etcd answers an unknown lease with TTL 0 rather than an error.
            raise LeaseExpired(f"lease {lease:x} is gone")
        if self._connection.health().state == "nospace":
            await self._check_space()
        return ttl

    def _drop_renewals(self) -> None:
        if self._renewals is not None:
            self._renewals.close()
            self._renewals = None

    async def _check_space(self) -> None:
        """While out of space, each renewal (every renew interval) also
        asks etcd's alarm list: a gateway that writes nothing learns that an
        operator disarmed the alarm within one renewal, not at its next
        write. One call per renewal, only while the alarm lasts."""
        try:
            with self._connection.calling("alarm list"):
                maintenance = (await self._services()).maintenance
                resp = await maintenance.alarms(timeout=self._timeout)
        except StoreError:
            return  # said by `calling`; the next renewal asks again
        if not any(a.alarm == NOSPACE_ALARM for a in resp.alarms):
            self._connection.space_back()

    async def compact(self, revision: int) -> None:
        """See `Store.compact`. Not physical: etcd answers once the
        compaction is decided, and frees the pages in the background."""
        try:
            with self._connection.calling("compact"):
                kv = (await self._services()).kv
                await kv.compact(revision, timeout=self._timeout)
        except StoreError as exc:
            if COMPACTED_DETAIL not in str(exc):
                raise

    async def revoke(self, lease: int) -> None:
        try:
            with self._connection.calling("revoke"):
                leases = (await self._services()).lease
                await leases.revoke(lease, timeout=self._timeout)
        except LeaseExpired:
            pass  # already gone: revoking is idempotent by contract

    # -- watch ----------------------------------------------------------------

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        """See `Store.watch`; the loop is app/store/etcd/watcher.py's."""
        return self._watcher.watch(prefix, start_revision)
