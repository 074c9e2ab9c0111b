"""The mirror's typed views are built once per change, and a node's long
poll wakes only for its own replicas (docs/design/scale.md)."""

from __future__ import annotations

import asyncio

import pytest

from app.control import state as s
from app.control.mirror import Mirror
from app.store.base import Event, KeyValue, RangeResult, WatchBatch
from tests.support.work import calls


def _replica(rid: str, node: str) -> bytes:
    return s.Replica(id=rid, model="m", node=node, weights="org/m").model_dump_json().encode()


def _status(rid: str, phase: str) -> bytes:
    return s.ReplicaStatus(id=rid, node="a", phase=phase).model_dump_json().encode()  # type: ignore[arg-type]


class Feed:
    """Applies one event at a time at the next revision."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self.revision = mirror.revision

    def put(self, key: str, value: bytes) -> int:
        self.revision += 1
        assert self.mirror.apply(WatchBatch(
            [Event("put", key, value, self.revision, create_revision=self.revision)],
            self.revision))
        return self.revision

    def delete(self, key: str) -> int:
        self.revision += 1
        assert self.mirror.apply(WatchBatch([Event("delete", key, b"", self.revision)],
                                            self.revision))
        return self.revision


def _mirror() -> tuple[Mirror, Feed]:
    mirror = Mirror(None)  # type: ignore[arg-type]  # apply() touches no store
    return mirror, Feed(mirror)


def test_a_view_is_built_once_until_its_prefix_changes() -> None:
    mirror, feed = _mirror()
    feed.put(s.REPLICAS + "r1", _replica("r1", "a"))
    feed.put(s.STATUS + "r1", _status("r1", "starting"))
    replicas, statuses = mirror.replicas(), mirror.statuses()
    assert mirror.replicas() is replicas and mirror.statuses() is statuses
    feed.put(s.STATUS + "r1", _status("r1", "ready"))
    # A status change leaves the replicas' view as it was...
    assert mirror.replicas() is replicas
    assert mirror.statuses() is not statuses
    assert mirror.statuses()["r1"].phase == "ready"
    # ...and a replica change rebuilds it, parsing only the key that changed.
    feed.put(s.REPLICAS + "r2", _replica("r2", "b"))
    after = mirror.replicas()
    assert after is not replicas and sorted(after) == ["r1", "r2"]
    assert after["r1"] is replicas["r1"]
    feed.delete(s.REPLICAS + "r1")
    assert sorted(mirror.replicas()) == ["r2"]


def test_a_changed_view_is_the_old_one_patched_as_a_full_parse_would_build_it() -> None:
    """A change patches the views it touches (a copy with those keys parsed
    again) rather than parsing the prefix anew: through random batches of
    puts, deletes and unreadable values, each view holds what `parsed()`
    builds, in its order, and values not changed are the same objects."""
    import random

    rng = random.Random(11)
    mirror, feed = _mirror()
    rids = [f"r{i:02d}" for i in range(30)]
    for rid in rids[:10]:
        feed.put(s.REPLICAS + rid, _replica(rid, "a"))
        feed.put(s.STATUS + rid, _status(rid, "ready"))
    for step in range(200):
        before = dict(mirror.replicas()), dict(mirror.statuses())
        events = []
        touched = set()
        for _ in range(rng.choice([1, 1, 2, 5])):
            rid = rng.choice(rids)
            key = rng.choice([s.REPLICAS, s.STATUS]) + rid
            touched.add(key)
            feed.revision += 1
            roll = rng.random()
            if roll < 0.5:
                value = (_replica(rid, rng.choice("abc")) if key.startswith(s.REPLICAS)
                         else _status(rid, rng.choice(["ready", "starting"])))
                events.append(Event("put", key, value, feed.revision,
                                    create_revision=feed.revision))
            elif roll < 0.6:
                events.append(Event("put", key, b"{not json", feed.revision,
                                    create_revision=feed.revision))
            else:
                events.append(Event("delete", key, b"", feed.revision))
        assert mirror.apply(WatchBatch(events, feed.revision))
        for view, prefix, cls, old in ((mirror.replicas(), s.REPLICAS, s.Replica, before[0]),
                                       (mirror.statuses(), s.STATUS, s.ReplicaStatus,
                                        before[1])):
            full = mirror.parsed(prefix, cls)
            assert list(view.items()) == list(full.items()), step
            for name, value in view.items():
                if prefix + name not in touched and name in old:
                    assert value is old[name], (step, name)


def test_a_status_report_costs_the_views_the_same_whatever_the_fleet_s_size() -> None:
    """One status changed: the statuses' view is patched, not parsed anew
    (at 10,000 nodes each report cost ~200 ms of the event loop)."""
    work = []
    for size in (100, 400):
        mirror, feed = _mirror()
        for i in range(size):
            feed.put(s.STATUS + f"r{i:04d}", _status(f"r{i:04d}", "ready"))
        assert len(mirror.statuses()) == size  # built once

        def report(m: Mirror = mirror, f: Feed = feed) -> None:
            f.put(s.STATUS + "r0007", _status("r0007", "starting"))
            assert m.statuses()["r0007"].phase == "starting"

        work.append(calls(report)[0])
    assert work[1] < 1.3 * work[0], work


def test_views_are_read_only() -> None:
    mirror, feed = _mirror()
    feed.put(s.REPLICAS + "r1", _replica("r1", "a"))
    with pytest.raises(TypeError):
        mirror.replicas()["r2"] = mirror.replicas()["r1"]  # type: ignore[index]
    # `parsed` still hands out a dict of the caller's own.
    mine = mirror.parsed(s.REPLICAS, s.Replica)
    mine.clear()
    assert list(mirror.replicas()) == ["r1"]


def test_an_unreadable_value_is_left_out_and_a_fixed_one_comes_back() -> None:
    mirror, feed = _mirror()
    feed.put(s.REPLICAS + "r1", b"{not json")
    assert dict(mirror.replicas()) == {}
    assert mirror.one(s.REPLICAS + "r1", s.Replica) is None
    feed.put(s.REPLICAS + "r1", _replica("r1", "a"))
    assert mirror.replicas()["r1"].node == "a"


class OneRange:
    def __init__(self, kvs: list[KeyValue], revision: int) -> None:
        self.result = RangeResult(kvs, revision)

    async def range(self, prefix: str) -> RangeResult:
        return self.result


async def test_a_resync_rebuilds_views_but_reuses_unchanged_values() -> None:
    kv = KeyValue(s.REPLICAS + "r1", _replica("r1", "a"), 3, 3, 0)
    store = OneRange([kv], 3)
    mirror = Mirror(store)  # type: ignore[arg-type]  # only range() is called
    await mirror.resync()
    before = mirror.replicas()
    store.result = RangeResult(
        [kv, KeyValue(s.REPLICAS + "r2", _replica("r2", "b"), 4, 4, 0)], 4)
    await mirror.resync()
    assert sorted(mirror.replicas()) == ["r1", "r2"]
    assert mirror.replicas()["r1"] is before["r1"]  # same key revision: not parsed again


async def test_a_prefix_read_is_what_a_scan_of_every_key_finds() -> None:
    """`items(prefix)` reads the prefix's first segment only (at 10,000
    nodes a scan of every key was a publish's largest cost): through random
    puts, deletes and a resync it lists what a scan of every key would."""
    import random

    rng = random.Random(5)
    names = ["nodes/a", "nodes/b", "nodesx", "catalog/models/m", "catalog/serial",
             "keyusage/k1/gw", "keyusage/k10/gw", "leader", "leader-write", "replicas/r"]
    prefixes = ["nodes/", "nodes", "catalog/", "catalog/models/", "keyusage/k1/",
                "keyusage/k1", "leader", "", "replicas/", "status/"]
    kept: dict[str, bytes] = {}
    mirror, feed = _mirror()

    def same() -> None:
        for p in prefixes:
            assert [kv.key for kv in mirror.items(p)] == sorted(
                k for k in kept if k.startswith(p)), p

    for _ in range(300):
        key = rng.choice(names)
        if rng.random() < 0.6:
            kept[key] = b"v"
            feed.put(key, b"v")
        else:
            kept.pop(key, None)
            feed.delete(key)
        same()
    store = OneRange([KeyValue(k, b"v", 1, 1, 0) for k in ("nodes/c", "leader")], 400)
    mirror._store = store  # type: ignore[assignment]  # only range() is called
    await mirror.resync()
    kept = {"nodes/c": b"v", "leader": b"v"}
    same()


async def _woken(mirror: Mirror, node: str, change: object) -> bool:
    seen = mirror.revision
    waiter = asyncio.create_task(mirror.wait_node_past(node, seen, 0.3))
    await asyncio.sleep(0)  # parked
    assert callable(change)
    change()
    for _ in range(3):
        await asyncio.sleep(0)
    woke = waiter.done()
    assert await waiter is woke  # a waiter not woken at once times out False
    return woke


async def test_a_long_poll_wakes_for_its_own_nodes_replicas_only() -> None:
    mirror, feed = _mirror()
    feed.put(s.REPLICAS + "r1", _replica("r1", "a"))
    feed.put(s.REPLICAS + "r2", _replica("r2", "b"))
    # Changes elsewhere: another node's replica, any status, a node's heartbeat.
    assert not await _woken(mirror, "a", lambda: feed.put(s.REPLICAS + "r2", _replica("r2", "b")))
    assert not await _woken(mirror, "a", lambda: feed.put(s.STATUS + "r1", _status("r1", "ready")))
    assert not await _woken(mirror, "a", lambda: feed.put(s.NODES + "a", b"{}"))
    # Its own: a replica placed on it, one moved away from it, one deleted.
    assert await _woken(mirror, "a", lambda: feed.put(s.REPLICAS + "r3", _replica("r3", "a")))
    assert await _woken(mirror, "a", lambda: feed.put(s.REPLICAS + "r3", _replica("r3", "b")))
    assert await _woken(mirror, "b", lambda: feed.delete(s.REPLICAS + "r3"))
    # A replica moved from a to b woke b too: both nodes' answers changed.
    assert mirror.node_revision("b") == mirror.revision


async def test_a_change_to_the_node_between_read_and_wait_is_not_missed() -> None:
    mirror, feed = _mirror()
    seen = mirror.revision
    feed.put(s.REPLICAS + "r1", _replica("r1", "a"))  # lands before the wait starts
    assert await mirror.wait_node_past("a", seen, 0.01)
    assert not await mirror.wait_node_past("b", seen, 0.01)


async def test_a_resync_wakes_every_long_poll() -> None:
    store = OneRange([], 5)
    mirror = Mirror(store)  # type: ignore[arg-type]  # only range() is called
    waiter = asyncio.create_task(mirror.wait_node_past("a", 0, 5))
    await asyncio.sleep(0)
    await mirror.resync()
    assert await asyncio.wait_for(waiter, 1)
