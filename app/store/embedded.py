"""`EmbeddedStore`: the store contract on SQLite, for a gateway running alone.

One file holds the keys and the revision counter. Leases and watches live in
memory: a gateway running alone is the only lease holder, so when it starts,
every lease of an earlier process is dead and its keys are deleted (as etcd
would after their TTL).

SQLite calls run synchronously on the event loop. With WAL and
synchronous=NORMAL a write is well under a millisecond, less than handing it
to a thread would cost. The price of synchronous=NORMAL: a power loss or OS
crash can roll back the last transactions committed since the WAL was last
synced (the file stays consistent); a process crash loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sqlite3
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.store.base import (
    Compare,
    Delete,
    Event,
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
from app.store.sqlite import connect, prefix_end, translated

logger = logging.getLogger(__name__)

# Events kept for watches that start in the past or fall behind. A watch
# older than this gets `compacted` and its reader resyncs with a full read; a
# larger log costs memory (an event holds its value) for rarer resyncs.
LOG_LIMIT = 10_000
# How often the background pass expires leases. The lease TTLs used are
# seconds long; a longer interval only leaves dead keys visible longer.
EXPIRY_INTERVAL_S = 0.5


@dataclass(slots=True)
class _Lease:
    ttl: int
    deadline: float


@dataclass(slots=True)
class _Write:
    """One store revision in the making: the events it will publish."""

    revision: int
    events: list[Event] = field(default_factory=list)


class EmbeddedStore:
    """The `Store` contract on one SQLite file. Build it with `open()`."""

    def __init__(
        self,
        db: sqlite3.Connection,
        clock: Callable[[], float] = time.monotonic,
        *,
        log_limit: int = LOG_LIMIT,
    ) -> None:
        self._db = db
        self._clock = clock
        self._log_limit = log_limit
        self._leases: dict[int, _Lease] = {}
        self._log: deque[Event] = deque()
        with translated("open"):
            row = db.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()
        self._revision = int(row[0])
        # Watches can replay from `_floor` on; nothing before this process.
        self._floor = self._revision + 1
        # Replaced on every write: watchers wait on the one they saw.
        self._wakeup = asyncio.Event()
        self._expiry_task: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        path: Path,
        clock: Callable[[], float] = time.monotonic,
        *,
        log_limit: int = LOG_LIMIT,
        expiry_interval: float | None = EXPIRY_INTERVAL_S,
    ) -> EmbeddedStore:
        """Opens (creating if needed) the store in `path`, drops the keys of
        leases from an earlier process and, unless `expiry_interval` is None,
        starts the lease expiry loop (tests pass None and call
        `expire_leases()` themselves)."""
        db = connect(path)
        try:
            store = cls(db, clock, log_limit=log_limit)
            dropped = store._drop_leased_keys()
        except BaseException:
            db.close()
            raise
        if dropped:
            logger.info("dropped %d keys of leases from an earlier process", dropped)
        if expiry_interval is not None:
            store._expiry_task = asyncio.create_task(
                store._expire_loop(expiry_interval), name="embedded-store-lease-expiry"
            )
        return store

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wakeup.set()  # watchers see `_closed` and end
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
            self._expiry_task = None
        self._db.close()

    def health(self) -> StoreHealth:
        # A file in this process: nothing to reach. A failing disk shows up
        # as errors of the calls themselves.
        return StoreHealth("reachable")

    # -- writes ---------------------------------------------------------------

    @contextlib.contextmanager
    def _writing(self, operation: str) -> Iterator[_Write]:
        """One revision: rows written inside share it; nothing changed, no revision."""
        self._check_open()
        write = _Write(self._revision + 1)
        with translated(operation):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield write
                if write.events:
                    self._db.execute(
                        "UPDATE meta SET value = ? WHERE name = 'revision'", (write.revision,)
                    )
                    self._db.execute("COMMIT")
                else:
                    self._db.execute("ROLLBACK")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        if write.events:
            self._revision = write.revision
            self._publish(write.events)

    def _put_row(self, write: _Write, key: str, value: bytes, lease: int) -> None:
        raw = key.encode()
        row = self._db.execute("SELECT create_revision FROM kv WHERE key = ?", (raw,)).fetchone()
        created = int(row[0]) if row else write.revision
        self._db.execute(
            "INSERT OR REPLACE INTO kv (key, value, create_revision, mod_revision, lease)"
            " VALUES (?, ?, ?, ?, ?)",
            (raw, value, created, write.revision, lease),
        )
        write.events.append(Event("put", key, value, write.revision, lease, created))

    def _delete_row(self, write: _Write, key: str) -> bool:
        cur = self._db.execute("DELETE FROM kv WHERE key = ?", (key.encode(),))
        if cur.rowcount == 0:
            return False
        write.events.append(Event("delete", key, b"", write.revision))
        return True

    def _delete_rows_where(self, write: _Write, where: str, args: tuple[int, ...]) -> int:
        keys = [bytes(r[0]) for r in self._db.execute(f"SELECT key FROM kv WHERE {where}", args)]
        for raw in keys:
            self._delete_row(write, raw.decode())
        return len(keys)

    def _drop_leased_keys(self) -> int:
        with self._writing("open") as write:
            return self._delete_rows_where(write, "lease != ?", (0,))

    def _publish(self, events: list[Event]) -> None:
        self._log.extend(events)
        while len(self._log) > self._log_limit:
            # A revision partly evicted can no longer be replayed whole.
            self._floor = self._log.popleft().mod_revision + 1
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()

    # -- reads ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("embedded store is closed")

    def _row(self, key: str) -> KeyValue | None:
        row = self._db.execute(
            "SELECT value, create_revision, mod_revision, lease FROM kv WHERE key = ?",
            (key.encode(),),
        ).fetchone()
        if row is None:
            return None
        return KeyValue(key, bytes(row[0]), int(row[1]), int(row[2]), int(row[3]))

    async def get(self, key: str) -> KeyValue | None:
        self._check_open()
        with translated("get"):
            return self._row(key)

    async def range(self, prefix: str) -> RangeResult:
        self._check_open()
        start = prefix.encode()
        end = prefix_end(start)
        sql = "SELECT key, value, create_revision, mod_revision, lease FROM kv WHERE key >= ?"
        args: tuple[bytes, ...] = (start,)
        if end is not None:
            sql += " AND key < ?"
            args = (start, end)
        with translated("range"):
            rows = self._db.execute(sql + " ORDER BY key", args).fetchall()
        kvs = [
            KeyValue(bytes(r[0]).decode(), bytes(r[1]), int(r[2]), int(r[3]), int(r[4]))
            for r in rows
        ]
        return RangeResult(kvs, self._revision)

    # -- key writes -----------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._check_open()
        self._require_lease(lease)
        with self._writing("put") as write:
            self._put_row(write, key, value, lease)
        return write.revision

    async def delete(self, key: str) -> bool:
        with self._writing("delete") as write:
            return self._delete_row(write, key)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        self._check_open()
        # Expire overdue leases first, in their own revisions, so that the
        # compares below see the keys as they are once those leases are gone.
        for op in (*success, *failure):
            if isinstance(op, Put) and op.lease:
                self._expire_if_due(op.lease)
        with self._writing("txn") as write:
            succeeded = all(self._holds(c) for c in compares)
            ops = success if succeeded else failure
            for op in ops:
                if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                    raise LeaseExpired(f"lease {op.lease:x} is gone")
            for op in ops:
                if isinstance(op, Put):
                    self._put_row(write, op.key, op.value, op.lease)
                elif isinstance(op, Delete):
                    self._delete_row(write, op.key)
                else:
                    raise TypeError(f"not a store op: {op!r}")
        return TxnResult(succeeded, self._revision)

    def _holds(self, compare: Compare) -> bool:
        kv = self._row(compare.key)
        if compare.target == "value":
            if not isinstance(compare.expected, bytes):
                raise TypeError(f"value compare on {compare.key!r} needs bytes")
            if kv is None:
                return False  # as etcd: a value compare on a missing key never holds
            actual: int | bytes = kv.value
        else:
            if not isinstance(compare.expected, int):
                raise TypeError(f"{compare.target} compare on {compare.key!r} needs an int")
            if kv is None:
                actual = 0
            else:
                actual = kv.create_revision if compare.target == "create" else kv.mod_revision
        equal = actual == compare.expected
        return equal if compare.op == "==" else not equal

    # -- leases ---------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        self._check_open()
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 s, not {ttl}")
        lease = 0
        while lease == 0 or lease in self._leases:
            lease = secrets.randbits(63)  # as etcd: a positive int64, never 0
        self._leases[lease] = _Lease(ttl, self._clock() + ttl)
        return lease

    async def keepalive(self, lease: int) -> int:
        self._check_open()
        self._require_lease(lease)
        state = self._leases[lease]
        state.deadline = self._clock() + state.ttl
        return state.ttl

    async def revoke(self, lease: int) -> None:
        self._check_open()
        if lease in self._leases:
            self._end_lease(lease)

    def expire_leases(self) -> int:
        """One expiry pass: ends every lease past its deadline, deleting its keys
        (each lease in its own revision, as etcd does). Returns how many ended."""
        if self._closed:
            return 0
        now = self._clock()
        due = [lid for lid, state in self._leases.items() if now >= state.deadline]
        for lease in due:
            self._end_lease(lease)
        return len(due)

    def _require_lease(self, lease: int) -> None:
        if lease == 0:
            return
        self._expire_if_due(lease)
        if lease not in self._leases:
            raise LeaseExpired(f"lease {lease:x} is gone")

    def _expire_if_due(self, lease: int) -> None:
        state = self._leases.get(lease)
        if state is not None and self._clock() >= state.deadline:
            self._end_lease(lease)

    def _end_lease(self, lease: int) -> None:
        # Forget the lease only once its keys are gone: if the write fails,
        # the next pass tries again.
        with self._writing("lease end") as write:
            self._delete_rows_where(write, "lease = ?", (lease,))
        self._leases.pop(lease, None)

    async def _expire_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                ended = self.expire_leases()
            except StoreError:
                logger.exception("lease expiry pass failed; retrying in %.1fs", interval)
                continue
            if ended:
                logger.info("%d leases expired", ended)

    async def compact(self, revision: int) -> None:
        """See `Store.compact`. Rows hold no history: only the log is trimmed."""
        self._check_open()
        if revision > self._revision:
            raise StoreError(f"embedded store compact: revision {revision} is in the future "
                             f"(store at {self._revision})")
        while self._log and self._log[0].mod_revision < revision:
            self._log.popleft()
        self._floor = max(self._floor, revision)

    # -- watch ----------------------------------------------------------------

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        """See `Store.watch`. Batches are yielded only when they hold events of
        `prefix`; `start_revision` 0 means "from the next write". Ends when the
        store is closed."""
        cursor = start_revision if start_revision > 0 else self._revision + 1
        while not self._closed:
            wakeup = self._wakeup
            if cursor < self._floor:
                # The log no longer holds what was asked: the reader resyncs.
                yield WatchBatch([], self._revision, compacted=True)
                cursor = self._revision + 1
                continue
            revision = self._revision
            events = self._events_since(cursor, prefix)
            cursor = max(cursor, revision + 1)
            if events:
                yield WatchBatch(events, revision)
                continue  # writes may have come while the reader had the batch
            await wakeup.wait()

    def _events_since(self, revision: int, prefix: str) -> list[Event]:
        found: list[Event] = []
        for event in reversed(self._log):
            if event.mod_revision < revision:
                break
            if event.key.startswith(prefix):
                found.append(event)
        found.reverse()
        return found
