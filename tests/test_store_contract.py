"""The store contract, run against both stores: the embedded one and a real etcd.

Code above the store never asks which one it has, so every behaviour it relies
on is asserted here for both. A few tests cover what only one store has:
lease expiry by the embedded store's clock, its durability, and etcd going
away and coming back (on an etcd of the test's own, `own_etcd`: the shared
one serves every other test).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from etcd3aio import Etcd3Client

from app.control import storeid
from app.store.base import (
    Compare,
    Delete,
    Event,
    LeaseExpired,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
    WatchBatch,
)
from app.store.embedded import EmbeddedStore
from app.store.etcd.store import EtcdStore
from tests.support.etcd import EtcdServer, ExternalEtcd, throwaway_etcd

# Small enough that a test can outrun it with a few dozen writes.
EMBEDDED_LOG_LIMIT = 50
WAIT_S = 5.0


@dataclass
class Case:
    kind: str
    store: Store
    # Makes every revision up to now unreplayable by a watch.
    lose_history: Callable[[], Awaitable[None]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Watcher:
    """Reads a watch in the background so a test can await what it delivers."""

    def __init__(self, store: Store, prefix: str, start_revision: int) -> None:
        self.batches: asyncio.Queue[WatchBatch] = asyncio.Queue()
        self._task = asyncio.create_task(self._run(store.watch(prefix, start_revision)))

    async def _run(self, batches: AsyncIterator[WatchBatch]) -> None:
        async for batch in batches:
            await self.batches.put(batch)

    async def next_batch(self, timeout: float = WAIT_S) -> WatchBatch:
        return await asyncio.wait_for(self.batches.get(), timeout)

    async def events(self, count: int, timeout: float = WAIT_S) -> list[Event]:
        found: list[Event] = []
        async with asyncio.timeout(timeout):
            while len(found) < count:
                batch = await self.batches.get()
                assert not batch.compacted, batch
                found.extend(batch.events)
        assert len(found) == count, found
        return found

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._task.done() and not self._task.cancelled():
            self._task.result()  # a watch that died on its own is a failure


async def _embedded_case(tmp_path: Path) -> Case:
    store = await EmbeddedStore.open(
        tmp_path / "store.db", log_limit=EMBEDDED_LOG_LIMIT, expiry_interval=None
    )

    async def lose_history() -> None:
        for i in range(EMBEDDED_LOG_LIMIT + 1):
            await store.put(f"zz-filler/{i}", b"x")

    return Case("embedded", store, lose_history)


async def _etcd_case(endpoint: str, prefix: str) -> Case:
    store = await EtcdStore.open([endpoint], prefix, timeout=2.0)

    async def lose_history() -> None:
        async with Etcd3Client([endpoint]) as raw:
            assert raw.kv is not None
            revision = (await raw.kv.get(b"\x00", range_end=b"\x00", count_only=True)).header
            await raw.kv.compact(revision.revision, physical=True)

    return Case("etcd", store, lose_history)


@pytest.fixture(params=["embedded", "etcd"])
async def case(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Case]:
    if request.param == "embedded":
        made = await _embedded_case(tmp_path)
    else:
        server = request.getfixturevalue("etcd_server")
        made = await _etcd_case(server.endpoint, request.getfixturevalue("etcd_prefix"))
    try:
        yield made
    finally:
        await made.store.close()


# -- the store's id (app/control/storeid.py) ------------------------------------


async def test_the_store_id_is_made_once_even_by_racing_callers(case: Case) -> None:
    made = await asyncio.gather(*(storeid.ensure(case.store, 1.0) for _ in range(3)))
    assert len(set(made)) == 1 and len(made[0]) == 32
    assert await storeid.ensure(case.store, 2.0) == made[0]


# -- keys ---------------------------------------------------------------------


async def test_get_put_delete(case: Case) -> None:
    store = case.store
    assert await store.get("models/a") is None
    revision = await store.put("models/a", b"one")
    kv = await store.get("models/a")
    assert kv is not None
    assert (kv.key, kv.value, kv.lease) == ("models/a", b"one", 0)
    assert kv.create_revision == kv.mod_revision == revision
    assert await store.delete("models/a") is True
    assert await store.get("models/a") is None
    assert await store.delete("models/a") is False


async def test_range_is_sorted_and_bounded_by_prefix(case: Case) -> None:
    store = case.store
    for key in ["nodes/b", "nodes/a", "nodes/c/x", "nodesx", "node", "other/a"]:
        await store.put(key, key.encode())
    result = await store.range("nodes/")
    assert [kv.key for kv in result.kvs] == ["nodes/a", "nodes/b", "nodes/c/x"]
    assert [kv.value for kv in result.kvs] == [b"nodes/a", b"nodes/b", b"nodes/c/x"]
    everything = await store.range("")
    assert [kv.key for kv in everything.kvs] == sorted(
        ["nodes/b", "nodes/a", "nodes/c/x", "nodesx", "node", "other/a"]
    )
    assert (await store.range("missing/")).kvs == []


async def test_revisions_count_writes(case: Case) -> None:
    store = case.store
    start = (await store.range("")).revision
    first = await store.put("k", b"1")
    second = await store.put("k", b"2")
    assert start < first < second
    kv = await store.get("k")
    assert kv is not None
    assert (kv.create_revision, kv.mod_revision) == (first, second)
    assert (await store.range("")).revision == second
    # Deleting nothing changes nothing, so it is no revision (as in etcd).
    assert await store.delete("absent") is False
    assert (await store.range("")).revision == second
    await store.delete("k")
    recreated = await store.put("k", b"3")
    kv = await store.get("k")
    assert kv is not None
    assert kv.create_revision == kv.mod_revision == recreated > second + 1


# -- transactions ---------------------------------------------------------------


async def test_txn_success_and_failure_branches(case: Case) -> None:
    store = case.store
    created = await store.txn([Compare.absent("cfg")], [Put("cfg", b"v1")], [Put("lost", b"x")])
    assert created.succeeded
    kv = await store.get("cfg")
    assert kv is not None and kv.value == b"v1" and kv.mod_revision == created.revision

    again = await store.txn([Compare.absent("cfg")], [Put("cfg", b"v2")], [Put("lost", b"y")])
    assert not again.succeeded
    assert (await store.get("cfg")) == kv
    lost = await store.get("lost")
    assert lost is not None and lost.value == b"y"

    value_eq = await store.txn([Compare("cfg", "value", "==", b"v1")], [Put("cfg", b"v2")])
    assert value_eq.succeeded
    value_ne = await store.txn([Compare("cfg", "value", "!=", b"v2")], [Put("cfg", b"v3")])
    assert not value_ne.succeeded
    current = await store.get("cfg")
    assert current is not None and current.value == b"v2"

    stale = await store.txn([Compare.modified_at("cfg", kv.mod_revision)], [Put("cfg", b"v4")])
    assert not stale.succeeded
    fresh = await store.txn(
        [Compare.modified_at("cfg", current.mod_revision), Compare("cfg", "create", "!=", 0)],
        [Put("cfg", b"v5"), Delete("lost")],
    )
    assert fresh.succeeded
    after = await store.get("cfg")
    assert after is not None and after.value == b"v5"
    # Both writes of a transaction are one revision.
    assert after.mod_revision == fresh.revision == current.mod_revision + 1
    assert await store.get("lost") is None


async def test_txn_value_compare_on_missing_key_never_holds(case: Case) -> None:
    store = case.store
    ops: tuple[Literal["==", "!="], ...] = ("==", "!=")
    for op in ops:
        result = await store.txn([Compare("nothing", "value", op, b"x")], [Put("t", b"1")])
        assert not result.succeeded
    assert await store.get("t") is None


async def test_fencing_refuses_a_former_leader(case: Case) -> None:
    store = case.store
    await store.put("leader", b"gw-1")
    term = await store.get("leader")
    assert term is not None
    fenced = [Compare.created_at("leader", term.create_revision)]
    assert (await store.txn(fenced, [Put("replicas/r1", b"from gw-1")])).succeeded

    # gw-1's term ends and another begins; the value could even be the same.
    await store.delete("leader")
    await store.put("leader", b"gw-1")
    result = await store.txn(fenced, [Put("replicas/r1", b"stale write")])
    assert not result.succeeded
    kv = await store.get("replicas/r1")
    assert kv is not None and kv.value == b"from gw-1"


# -- leases -----------------------------------------------------------------------


async def test_lease_lifecycle(case: Case) -> None:
    store = case.store
    lease = await store.grant(30)
    assert lease != 0
    await store.put("gateways/a", b"x", lease=lease)
    await store.put("gateways/b", b"y", lease=lease)
    await store.put("keep", b"z")
    kv = await store.get("gateways/a")
    assert kv is not None and kv.lease == lease
    assert await store.keepalive(lease) == 30

    await store.revoke(lease)
    assert [kv.key for kv in (await store.range("")).kvs] == ["keep"]
    with pytest.raises(LeaseExpired):
        await store.keepalive(lease)
    with pytest.raises(LeaseExpired):
        await store.put("gateways/a", b"x", lease=lease)
    with pytest.raises(LeaseExpired):
        await store.txn([], [Put("gateways/a", b"x", lease=lease)])
    assert await store.get("gateways/a") is None
    await store.revoke(lease)  # unknown leases are ignored


# -- watches ------------------------------------------------------------------------


async def test_watch_sees_puts_and_deletes_in_order(case: Case) -> None:
    store = case.store
    start = (await store.range("catalog/")).revision
    watcher = Watcher(store, "catalog/", start + 1)
    try:
        await asyncio.sleep(0.1)  # let the watch be in place; it must not matter
        r1 = await store.put("catalog/a", b"1")
        await store.put("elsewhere", b"not watched")
        r2 = await store.put("catalog/b", b"2")
        r3 = await store.put("catalog/a", b"3")
        txn = await store.txn([], [Delete("catalog/a"), Put("catalog/c", b"4")])
        events = await watcher.events(5)
    finally:
        await watcher.stop()
    assert [(e.kind, e.key, e.value, e.mod_revision) for e in events] == [
        ("put", "catalog/a", b"1", r1),
        ("put", "catalog/b", b"2", r2),
        ("put", "catalog/a", b"3", r3),
        ("delete", "catalog/a", b"", txn.revision),
        ("put", "catalog/c", b"4", txn.revision),
    ]
    assert events[2].create_revision == r1
    assert events[4].create_revision == txn.revision


async def test_watch_from_an_old_revision_replays(case: Case) -> None:
    store = case.store
    r1 = await store.put("status/x", b"starting")
    r2 = await store.put("status/x", b"ready")
    r3 = await store.put("status/y", b"starting")
    await store.delete("status/y")
    watcher = Watcher(store, "status/", r2)
    try:
        replayed = await watcher.events(3)
        r5 = await store.put("status/z", b"new")
        live = await watcher.events(1)
    finally:
        await watcher.stop()
    assert r1 < r2
    assert [(e.kind, e.key, e.mod_revision) for e in replayed] == [
        ("put", "status/x", r2),
        ("put", "status/y", r3),
        ("delete", "status/y", r3 + 1),
    ]
    assert [(e.key, e.value, e.mod_revision) for e in live] == [("status/z", b"new", r5)]


async def test_watch_reports_history_it_cannot_replay(case: Case) -> None:
    store = case.store
    old = await store.put("keys/a", b"1")
    await store.put("keys/a", b"2")
    await case.lose_history()
    latest = (await store.range("")).revision
    watcher = Watcher(store, "keys/", old)
    try:
        batch = await watcher.next_batch()
        assert batch.compacted
        assert batch.events == []
        assert batch.revision >= latest
        # The watch goes on after the gap: the reader resyncs and keeps reading.
        after = await store.put("keys/b", b"3")
        (event,) = await watcher.events(1)
    finally:
        await watcher.stop()
    assert (event.key, event.mod_revision) == ("keys/b", after)


async def test_compact_forgets_the_history_before_a_revision(case: Case) -> None:
    """`compact` (the leader's, app/control/compaction.py): a watch from
    before the revision resyncs, one from it on replays, keys stay."""
    store = case.store
    old = await store.put("hist/a", b"1")
    await store.put("hist/a", b"2")
    kept = await store.put("hist/b", b"3")
    await store.compact(kept)
    assert [(kv.key, kv.value) for kv in (await store.range("hist/")).kvs] == [
        ("hist/a", b"2"), ("hist/b", b"3")]
    early, late = Watcher(store, "hist/", old), Watcher(store, "hist/", kept)
    try:
        assert (await early.next_batch()).compacted
        (event,) = await late.events(1)
    finally:
        await early.stop()
        await late.stop()
    assert (event.key, event.mod_revision) == ("hist/b", kept)
    await store.compact(old)  # already compacted: nothing to do, no error
    with pytest.raises(StoreError):
        await store.compact(kept + 1_000_000)  # a revision not written yet


# -- embedded store only ----------------------------------------------------------------


async def test_embedded_leases_expire_by_the_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    store = await EmbeddedStore.open(tmp_path / "s.db", clock, expiry_interval=None)
    try:
        lease = await store.grant(10)
        await store.put("nodes/n1", b"up", lease=lease)
        watcher = Watcher(store, "nodes/", (await store.range("")).revision + 1)
        clock.advance(9)
        assert store.expire_leases() == 0
        assert await store.keepalive(lease) == 10  # the deadline is now +10 from here
        clock.advance(9)
        assert store.expire_leases() == 0
        assert await store.get("nodes/n1") is not None
        clock.advance(1)
        assert store.expire_leases() == 1
        assert await store.get("nodes/n1") is None
        (event,) = await watcher.events(1)
        await watcher.stop()
        assert (event.kind, event.key) == ("delete", "nodes/n1")
        assert store.expire_leases() == 0
        with pytest.raises(LeaseExpired):
            await store.keepalive(lease)
    finally:
        await store.close()


async def test_embedded_overdue_lease_is_expired_when_used(tmp_path: Path) -> None:
    clock = FakeClock()
    store = await EmbeddedStore.open(tmp_path / "s.db", clock, expiry_interval=None)
    try:
        first = await store.grant(5)
        second = await store.grant(5)
        await store.put("a", b"1", lease=first)
        await store.put("b", b"2", lease=second)
        clock.advance(5)
        # No expiry pass ran: using the lease finds it dead and removes its keys.
        with pytest.raises(LeaseExpired):
            await store.keepalive(first)
        assert await store.get("a") is None
        with pytest.raises(LeaseExpired):
            await store.put("b", b"3", lease=second)
        assert await store.get("b") is None
        assert store.expire_leases() == 0
    finally:
        await store.close()


async def test_embedded_store_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "data" / "store.db"
    store = await EmbeddedStore.open(path, expiry_interval=None)
    await store.put("catalog/models/m", b"spec")
    lease = await store.grant(60)
    await store.put("nodes/n1", b"alive", lease=lease)
    before = (await store.range("")).revision
    await store.close()

    reopened = await EmbeddedStore.open(path, expiry_interval=None)
    try:
        after = await reopened.range("")
        # The earlier process's lease died with it, and its keys with it.
        assert [kv.key for kv in after.kvs] == ["catalog/models/m"]
        assert after.kvs[0].value == b"spec"
        assert after.revision == before + 1  # the deletion of nodes/n1
        assert await reopened.put("x", b"y") == before + 2
        with pytest.raises(LeaseExpired):
            await reopened.keepalive(lease)
        # History from before the reopen cannot be replayed.
        watcher = Watcher(reopened, "", before)
        batch = await watcher.next_batch()
        await watcher.stop()
        assert batch.compacted
    finally:
        await reopened.close()


async def test_embedded_store_refuses_a_second_opener(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = await EmbeddedStore.open(path, expiry_interval=None)
    try:
        with pytest.raises(StoreUnavailable):
            await EmbeddedStore.open(path, expiry_interval=None)
    finally:
        await store.close()


async def test_embedded_expiry_loop_runs_by_itself(tmp_path: Path) -> None:
    clock = FakeClock()
    store = await EmbeddedStore.open(tmp_path / "s.db", clock, expiry_interval=0.01)
    try:
        lease = await store.grant(1)
        written = await store.put("k", b"v", lease=lease)
        watcher = Watcher(store, "k", written + 1)
        clock.advance(2)
        (event,) = await watcher.events(1)  # no call here touches the lease
        await watcher.stop()
        assert (event.kind, event.key) == ("delete", "k")
        assert await store.get("k") is None
    finally:
        await store.close()


async def test_embedded_store_id_survives_reopen_and_a_new_database_has_another(
    tmp_path: Path,
) -> None:
    path = tmp_path / "store.db"
    store = await EmbeddedStore.open(path, expiry_interval=None)
    made = await storeid.ensure(store, 1.0)
    await store.close()
    reopened = await EmbeddedStore.open(path, expiry_interval=None)
    try:
        assert await storeid.ensure(reopened, 2.0) == made
    finally:
        await reopened.close()
    other = await EmbeddedStore.open(tmp_path / "other.db", expiry_interval=None)
    try:
        assert await storeid.ensure(other, 1.0) not in ("", made)
    finally:
        await other.close()


# -- etcd only ----------------------------------------------------------------------------


async def _cluster_id(endpoint: str) -> int:
    async with Etcd3Client([endpoint]) as raw:
        assert raw.kv is not None
        return int((await raw.kv.get(b"x")).header.cluster_id)


async def test_etcd_store_id_is_one_per_etcd_even_one_bootstrapped_again(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    async def ids(endpoint: str, clients: int = 1) -> list[str]:
        stores = [await EtcdStore.open([endpoint], etcd_prefix, timeout=2.0)
                  for _ in range(clients)]
        try:
            return [await storeid.ensure(one, 1.0) for one in stores]
        finally:
            for one in stores:
                await one.close()

    shared, again = await ids(etcd_server.endpoint, clients=2)
    assert shared == again and len(shared) == 32
    with throwaway_etcd(tmp_path) as own:
        (first,) = await ids(own.endpoint)
        assert first != shared
        # Wiped and bootstrapped with the same flags: etcd's own cluster id
        # is the same (a hash of the member's name and peer URL), but the
        # revisions count from 1 again, so the store id must differ.
        cluster = await _cluster_id(own.endpoint)
        own.stop()
        shutil.rmtree(own.data_dir)
        own.start()
        assert await _cluster_id(own.endpoint) == cluster
        (second,) = await ids(own.endpoint)
        assert second not in (first, shared)


async def test_etcd_prefix_isolation(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    # A neighbour whose prefix shares our prefix's text up to the slash, and a
    # raw key just outside ours: neither may leak in.
    neighbour = etcd_prefix.rstrip("/") + "-b/"
    ours = await EtcdStore.open([etcd_server.endpoint], etcd_prefix, timeout=2.0)
    theirs = await EtcdStore.open([etcd_server.endpoint], neighbour, timeout=2.0)
    try:
        watcher = Watcher(ours, "", (await ours.range("")).revision + 1)
        await theirs.put("k", b"theirs")
        await theirs.put("x/y", b"theirs")
        async with Etcd3Client([etcd_server.endpoint]) as raw:
            assert raw.kv is not None
            await raw.kv.put(etcd_prefix.rstrip("/") + "k", b"raw")
            mine = await ours.put("k", b"ours")
            stored = await raw.kv.get(etcd_prefix + "k")
            assert [bytes(kv.value) for kv in stored.kvs] == [b"ours"]
        (event,) = await watcher.events(1)
        await watcher.stop()
        assert (event.key, event.value, event.mod_revision) == ("k", b"ours", mine)
        assert [(kv.key, kv.value) for kv in (await ours.range("")).kvs] == [("k", b"ours")]
        got = await ours.get("k")
        assert got is not None and got.value == b"ours"
        assert await ours.get("x/y") is None
        assert [kv.key for kv in (await theirs.range("")).kvs] == ["k", "x/y"]
    finally:
        await ours.close()
        await theirs.close()


async def test_etcd_prefix_gets_its_slash(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    bare = etcd_prefix.rstrip("/")
    store = await EtcdStore.open([etcd_server.endpoint], bare, timeout=2.0)
    sibling = await EtcdStore.open([etcd_server.endpoint], bare + "2/", timeout=2.0)
    try:
        await sibling.put("k", b"sibling")
        assert (await store.range("")).kvs == []
        await store.put("k", b"v")
        got = await sibling.get("k")
        assert got is not None and got.value == b"sibling"
    finally:
        await store.close()
        await sibling.close()


async def test_etcd_renewals_ride_one_stream_each_answer_paired_with_its_lease(
        etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str) -> None:
    """A renewal writes one request on the stream the last one left open
    (a fresh stream per renewal was an idle gateway's largest cost); renewals
    at once take turns on it, each getting its own lease's answer; a lease
    gone is said as before, and the stream serves on."""
    store = await EtcdStore.open([etcd_server.endpoint], etcd_prefix, timeout=5.0)
    try:
        short, long = await store.grant(30), await store.grant(60)
        assert await store.keepalive(short) == 30
        assert store._renewals is not None
        stream = store._renewals.call
        assert [await store.keepalive(long) for _ in range(3)] == [60, 60, 60]
        assert await asyncio.gather(store.keepalive(short), store.keepalive(long),
                                    store.keepalive(short)) == [30, 60, 30]
        await store.revoke(long)
        with pytest.raises(LeaseExpired):
            await store.keepalive(long)
        assert await store.keepalive(short) == 30
        assert store._renewals is not None and store._renewals.call is stream, (
            "a renewal opened a stream of its own")
    finally:
        await store.close()
    assert stream.done(), "the store closed, its renewals' stream left open"


async def test_etcd_frozen_calls_time_out(own_etcd: EtcdServer, etcd_prefix: str) -> None:
    timeout = 1.0
    store = await EtcdStore.open([own_etcd.endpoint], etcd_prefix, timeout=timeout)
    try:
        lease = await store.grant(60)
        await store.put("before", b"1")
        own_etcd.pause()
        try:
            for call in _every_call(store, lease):
                began = time.monotonic()
                with pytest.raises(StoreUnavailable) as raised:
                    await asyncio.wait_for(call(), timeout * 3)
                assert timeout * 0.9 < time.monotonic() - began < timeout * 2
                assert raised.value.__cause__ is not None
        finally:
            own_etcd.resume()
        kv = await store.get("before")
        assert kv is not None and kv.value == b"1"
    finally:
        await store.close()


async def test_etcd_renewals_at_once_each_fail_within_the_timeout_when_etcd_freezes(
        own_etcd: EtcdServer, etcd_prefix: str) -> None:
    """Renewals take turns on one stream (the election's, a node's asked by
    its agent); with etcd frozen, each still answers within the call's
    timeout, its wait for its turn included, not one timeout after another."""
    timeout = 1.0
    store = await EtcdStore.open([own_etcd.endpoint], etcd_prefix, timeout=timeout)
    try:
        leases = [await store.grant(60) for _ in range(3)]
        await store.keepalive(leases[0])
        own_etcd.pause()
        try:
            began = time.monotonic()
            got = await asyncio.gather(*(store.keepalive(lease) for lease in leases),
                                       return_exceptions=True)
            took = time.monotonic() - began
        finally:
            own_etcd.resume()
        assert all(isinstance(g, StoreUnavailable) for g in got), got
        assert took < timeout * 1.5, f"three renewals at once took {took:.2f} s"
        assert await store.keepalive(leases[1]) == 60  # a new stream after the failure
    finally:
        await store.close()


def _every_call(store: Store, lease: int) -> list[Callable[[], Awaitable[object]]]:
    return [
        lambda: store.get("before"),
        lambda: store.put("during", b"x"),
        lambda: store.range(""),
        lambda: store.txn([Compare.absent("x")], [Put("x", b"1")]),
        lambda: store.keepalive(lease),
        lambda: store.grant(10),
    ]


async def test_etcd_down_then_back(own_etcd: EtcdServer, etcd_prefix: str) -> None:
    timeout = 1.0
    store = await EtcdStore.open([own_etcd.endpoint], etcd_prefix, timeout=timeout)
    watcher = None
    try:
        lease = await store.grant(60)
        start = await store.put("before", b"1")
        watcher = Watcher(store, "", start + 1)
        await asyncio.sleep(0.2)  # the watch is established before etcd goes

        own_etcd.stop()
        for call in _every_call(store, lease):
            began = time.monotonic()
            with pytest.raises(StoreUnavailable) as raised:
                await asyncio.wait_for(call(), timeout * 3)
            assert time.monotonic() - began < timeout * 2
            assert raised.value.__cause__ is not None

        own_etcd.start()
        # gRPC reconnects with its own backoff; a gateway retries its writes.
        async with asyncio.timeout(15):
            while True:
                try:
                    after = await store.put("after", b"2")
                    break
                except StoreUnavailable:
                    await asyncio.sleep(0.2)
        (event,) = await watcher.events(1, timeout=15)
        assert (event.kind, event.key, event.mod_revision) == ("put", "after", after)
        assert await store.keepalive(lease) == 60
    finally:
        if watcher is not None:
            await watcher.stop()
        await store.close()


async def test_etcd_watch_cut_before_its_replay_skips_nothing(
    own_etcd: EtcdServer, etcd_prefix: str
) -> None:
    """etcd answers a watch from an old revision with "created" (headed with
    the *current* revision) and replays the history up to 100 ms later. etcd
    is killed the moment "created" is read, inside that window: the watch
    must reopen from the start revision, not from the header's, and deliver
    every event once, in order, then go on with the live ones."""
    store = await EtcdStore.open([own_etcd.endpoint], etcd_prefix, timeout=1.0)
    killed = asyncio.Event()

    class KillOnCreated(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not killed.is_set() and "created" in record.getMessage():
                own_etcd.kill()  # synchronous: nothing more is sent
                killed.set()

    etcd_log = logging.getLogger("app.store.etcd")
    handler, level = KillOnCreated(logging.DEBUG), etcd_log.level
    watcher = None
    try:
        old = [await store.put(f"jobs/{i}", str(i).encode()) for i in range(3)]
        await store.put("elsewhere", b"not watched")
        await store.delete("jobs/0")
        deleted = (await store.range("")).revision
        etcd_log.setLevel(logging.DEBUG)
        etcd_log.addHandler(handler)
        watcher = Watcher(store, "jobs/", old[0])
        await asyncio.wait_for(killed.wait(), WAIT_S)
        etcd_log.removeHandler(handler)
        etcd_log.setLevel(level)

        own_etcd.start()
        new: list[int] = []
        async with asyncio.timeout(15):
            for i in range(3, 5):
                while True:
                    try:
                        new.append(await store.put(f"jobs/{i}", str(i).encode()))
                        break
                    except StoreUnavailable:
                        await asyncio.sleep(0.1)
        expected = [
            ("put", "jobs/0", old[0]),
            ("put", "jobs/1", old[1]),
            ("put", "jobs/2", old[2]),
            ("delete", "jobs/0", deleted),
            ("put", "jobs/3", new[0]),
            ("put", "jobs/4", new[1]),
        ]
        # Read up to the last write, so a gap shows as a diff, not a timeout.
        events: list[Event] = []
        async with asyncio.timeout(15):
            while not events or events[-1].mod_revision < new[-1]:
                batch = await watcher.next_batch(timeout=15)
                assert not batch.compacted, batch
                events.extend(batch.events)
        assert [(e.kind, e.key, e.mod_revision) for e in events] == expected
        await asyncio.sleep(0.3)
        assert watcher.batches.empty(), "an event was delivered twice"
    finally:
        etcd_log.removeHandler(handler)
        etcd_log.setLevel(level)
        if watcher is not None:
            await watcher.stop()
        await store.close()


def _etcd_watchers(endpoint: str) -> int:
    """etcd's own count of open watchers, from its metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=2.0) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_watcher_total "):
                return int(float(line.split()[1]))
    raise AssertionError("etcd reports no etcd_debugging_mvcc_watcher_total")


async def test_etcd_watch_ends_its_stream_when_the_reader_stops(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    if isinstance(etcd_server, ExternalEtcd):
        pytest.skip("LLMGW_TEST_ETCD: other clients' watchers would skew the count")
    store = await EtcdStore.open([etcd_server.endpoint], etcd_prefix, timeout=2.0)
    try:
        before = await asyncio.to_thread(_etcd_watchers, etcd_server.endpoint)
        first = await store.put("k", b"1")
        closed = store.watch("", first)
        batch = await anext(closed)
        assert [e.mod_revision for e in batch.events] == [first]
        cancelled = Watcher(store, "", first + 1)  # waiting in a read when cancelled
        await asyncio.sleep(0.2)
        assert await asyncio.to_thread(_etcd_watchers, etcd_server.endpoint) == before + 2
        await closed.aclose()  # type: ignore[attr-defined]
        await cancelled.stop()
        for _ in range(int(WAIT_S / 0.05)):
            left = await asyncio.to_thread(_etcd_watchers, etcd_server.endpoint)
            if left == before:
                break
            await asyncio.sleep(0.05)
        assert left == before, "a stopped watch left its stream open in etcd"
    finally:
        await store.close()
