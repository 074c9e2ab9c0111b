"""`EtcdStore`: the store contract over etcd v3, with etcd3aio's services on a
channel of our own (app/store/etcd_channel.py: host names, IPv6, re-resolving).

Every key is stored under `prefix` (LLMGW_ETCD_PREFIX) and handed back without
it, so several installations (or test runs) can share one etcd.

Errors: etcd3aio retries a unary call on UNAVAILABLE / DEADLINE_EXCEEDED (3
attempts) and then raises `EtcdConnectionError` / `EtcdTransientError`; its
`asyncio.timeout` around the retries raises a bare `TimeoutError`; streams and
every other status come out as raw `grpc.aio.AioRpcError`. `translated` makes
them `LeaseExpired` ("lease not found"), `StoreError` (etcd refused the request
itself), `StoreFull` (a write refused under etcd's NOSPACE alarm) or
`StoreUnavailable` (everything else: a 503). Each call's outcome also tells
`health()` whether etcd is reachable or out of space (app/store/health.py).

Watches run on our own loop over the gRPC Watch stream, in
app/store/etcd_watch.py (why not etcd3aio's `WatchService.watch`: see there).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc  # type: ignore[import-untyped]  # no type information shipped
from etcd3aio import SortOrder, SortTarget, prefix_range_end

from app.store import etcd_watch
from app.store.base import (
    Compare,
    KeyValue,
    LeaseExpired,
    Op,
    Put,
    RangeResult,
    StoreError,
    StoreFull,
    StoreHealth,
    StoreUnavailable,
    TxnResult,
    WatchBatch,
)
from app.store.etcd_channel import EtcdChannel, Resolver, Services, getaddrinfo
from app.store.etcd_endpoints import parse_endpoints
from app.store.etcd_tls import EtcdTls, explained
from app.store.etcd_wire import COMPACTED_DETAIL, pb_compare, pb_op, translated
from app.store.health import HealthTracker

# etcd's AlarmType.NOSPACE in an alarm list (0 is none, 2 corrupt).
NOSPACE_ALARM = 1


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
        self._endpoints = parse_endpoints(endpoints)
        # https endpoints: verified against `tls.ca` (None: the system's
        # CAs). TLS files with plain endpoints would be silently unused.
        if self._endpoints[0].tls:
            self._tls: EtcdTls | None = tls or EtcdTls()
        elif tls is not None:
            raise ValueError("etcd TLS files are set but the etcd endpoints are not "
                             "https://; write them as https://host:port")
        else:
            self._tls = None
        # "/llmgw" would also match "/llmgw2/...": a prefix names a folder.
        self._prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self._timeout = timeout
        # Cap of the watch's reconnect backoff (it starts at 0.1 s). A watch
        # that feeds the router should notice a restarted etcd soon; lower
        # costs only a few more connection attempts while etcd is down.
        self._watch_max_backoff = watch_max_backoff
        self._resolver = resolver
        # Keys per Range page (`range`): 1000 keys fit the client's 4 MiB
        # message cap while they average under 4 KiB; ours (replicas,
        # statuses, nodes) are a few hundred bytes each.
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, not {page_size}")
        self._page_size = page_size
        self._resolve_interval = resolve_interval
        self._channel: EtcdChannel | None = None
        self._closed = False
        self._health = HealthTracker("etcd at " + ",".join(map(str, self._endpoints)))

    @classmethod
    async def open(cls, endpoints: Sequence[str], prefix: str, timeout: float = 5.0,
                   tls: EtcdTls | None = None) -> EtcdStore:
        store = cls(endpoints, prefix, timeout, tls=tls)
        await store.connect()
        return store

    async def connect(self) -> None:
        """Prepares the channel. Names are resolved and members connected
        lazily: a down etcd (or a name not resolving yet) is reported by the
        first call, not here, so a gateway can start while etcd restarts."""
        self._channel = EtcdChannel(self._endpoints, self._timeout, self._resolver,
                                    resolve_interval=self._resolve_interval, tls=self._tls)
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    def health(self) -> StoreHealth:
        return self._health.current()

    # -- calls ----------------------------------------------------------------

    async def _services(self) -> Services:
        if self._channel is None:
            raise StoreUnavailable("etcd store is not connected")
        return await self._channel.services()

    @contextlib.contextmanager
    def _calling(self, operation: str, write: bool = False) -> Iterator[None]:
        """`translated`, and what the outcome says about reaching etcd: any
        answer (even "lease not found") proves it reachable; an unavailable
        store is reported, and its names are looked up again next time. A
        `write` (a call etcd refuses under NOSPACE) that succeeds proves
        the space back; a refused one says the store is full."""
        try:
            with translated(operation):
                yield
        except StoreFull as exc:
            self._health.full(str(exc))
            raise
        except StoreUnavailable as exc:
            self._lost(str(exc))
            raise
        except StoreError:
            self._health.succeeded()
            raise
        self._health.succeeded(write)

    def _lost(self, reason: str) -> None:
        if self._closed:
            return  # our own close, not an outage
        # gRPC's words for a failed handshake, said as what to fix.
        self._health.failed(explained(reason) if self._tls else reason)
        if self._channel is not None:
            self._channel.failed()

    # -- keys -----------------------------------------------------------------

    def _full(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    def _relative(self, raw: bytes) -> str | None:
        key = raw.decode()
        return key[len(self._prefix) :] if key.startswith(self._prefix) else None

    def _range_bounds(self, prefix: str) -> tuple[bytes, bytes]:
        start = self._full(prefix)
        if not start:
            # An empty key is refused by etcd; "\0" to "\0" means every key.
            return b"\x00", b"\x00"
        return start, prefix_range_end(start)

    def _key_value(self, kv: Any) -> KeyValue | None:
        key = self._relative(kv.key)
        if key is None:
            return None
        return KeyValue(key, bytes(kv.value), kv.create_revision, kv.mod_revision, kv.lease)

    # -- reads and writes -----------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        with self._calling("get"):
            kv = (await self._services()).kv
            resp = await kv.get(self._full(key), timeout=self._timeout)
        return self._key_value(resp.kvs[0]) if resp.kvs else None

    async def range(self, prefix: str) -> RangeResult:
        """Every key under `prefix`, read in pages of `page_size` keys.

        One unbounded Range answers in one gRPC message, and the client
        refuses a message over 4 MiB: a large fleet's state (thousands of
        replicas, statuses, nodes) would fail to load at all. Each page
        continues from the last key read + a zero byte (the next possible
        key), and every page after the first is read at the first one's
        revision, so the pages form one consistent snapshot (a resync must
        not mix two states: docs/architecture.md, Scale). If that revision
        is compacted meanwhile, etcd refuses the read (StoreError) and the
        caller reads again from the start.
        """
        start, end = self._range_bounds(prefix)
        kvs: list[KeyValue] = []
        revision = 0
        while True:
            with self._calling("range"):
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
            kvs += [kv for kv in map(self._key_value, resp.kvs) if kv is not None]
            if not resp.more or not resp.kvs:
                return RangeResult(kvs, revision)
            start = bytes(resp.kvs[-1].key) + b"\x00"

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        with self._calling("put", write=True):
            kv = (await self._services()).kv
            resp = await kv.put(self._full(key), value, lease=lease, timeout=self._timeout)
        return int(resp.header.revision)

    async def delete(self, key: str) -> bool:
        with self._calling("delete"):
            kv = (await self._services()).kv
            resp = await kv.delete(self._full(key), timeout=self._timeout)
        return bool(resp.deleted > 0)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        pb_compares = [pb_compare(c, self._full(c.key)) for c in compares]
        # etcd refuses any transaction holding a put under NOSPACE, whichever
        # branch runs; one accepted proves the space back.
        writes = any(isinstance(op, Put) for op in (*success, *failure))
        with self._calling("txn", write=writes):
            kv = (await self._services()).kv
            resp = await kv.txn(
                pb_compares,
                [pb_op(op, self._full(op.key)) for op in success],
                [pb_op(op, self._full(op.key)) for op in failure],
                timeout=self._timeout,
            )
        return TxnResult(bool(resp.succeeded), int(resp.header.revision))

    # -- leases ---------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        with self._calling("grant", write=True):
            leases = (await self._services()).lease
            resp = await leases.grant(ttl, timeout=self._timeout)
        if resp.error:
            raise StoreError(f"etcd grant: {resp.error}")
        return int(resp.ID)

    async def keepalive(self, lease: int) -> int:
        """One keepalive on a fresh stream. No background task: the caller (the
        leader election) paces renewals and times the last success itself,
        because a client-side "alive" flag stays true while etcd is down."""
        with self._calling("keepalive"):
            call = (await self._services()).lease.keep_alive(lease)
            try:
                async with asyncio.timeout(self._timeout):
                    resp = await call.read()
            finally:
                call.cancel()
        if resp is grpc.aio.EOF:
            raise StoreUnavailable("etcd keepalive: stream closed without an answer")
        if resp.TTL <= 0:
            # etcd answers an unknown lease with TTL 0 rather than an error.
            raise LeaseExpired(f"lease {lease:x} is gone")
        if self._health.current().state == "nospace":
            await self._check_space()
        return int(resp.TTL)

    async def _check_space(self) -> None:
        """While out of space, each renewal (every election interval) also
        asks etcd's alarm list: a gateway that writes nothing learns that an
        operator disarmed the alarm within one interval, not at its next
        write. One call per renewal, only while the alarm lasts."""
        try:
            with self._calling("alarm list"):
                maintenance = (await self._services()).maintenance
                resp = await maintenance.alarms(timeout=self._timeout)
        except StoreError:
            return  # said by _calling; the next renewal asks again
        if not any(a.alarm == NOSPACE_ALARM for a in resp.alarms):
            self._health.space_back()

    async def compact(self, revision: int) -> None:
        """See `Store.compact`. Not physical: etcd answers once the
        compaction is decided, and frees the pages in the background."""
        try:
            with self._calling("compact"):
                kv = (await self._services()).kv
                await kv.compact(revision, timeout=self._timeout)
        except StoreError as exc:
            if COMPACTED_DETAIL not in str(exc):
                raise

    async def revoke(self, lease: int) -> None:
        try:
            with self._calling("revoke"):
                leases = (await self._services()).lease
                await leases.revoke(lease, timeout=self._timeout)
        except LeaseExpired:
            pass  # already gone: revoking is idempotent by contract

    # -- watch ----------------------------------------------------------------

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        """See `Store.watch`; the loop is `watch` in app/store/etcd_watch.py."""
        return etcd_watch.watch(self, prefix, start_revision)
