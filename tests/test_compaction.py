"""The leader compacts etcd's history (app/control/compaction.py;
docs/design/security-operations.md, "A month of uptime"): in steps driven here with an
injected clock, on a real etcd, and as the gateways run it, with their
mirrors following writes across compactions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc  # type: ignore[import-untyped]
import pytest
from etcd3aio import Etcd3Client

from app.control.compaction import Compactor
from app.store.base import StoreUnavailable
from app.store.etcd.store import EtcdStore
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import until
from tests.test_agent_api import gateways

INTERVAL = 300.0


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


async def readable_at(endpoint: str, revision: int) -> bool:
    """Whether etcd still answers a read at `revision` (False: compacted)."""
    async with Etcd3Client([endpoint]) as raw:
        assert raw.kv is not None
        try:
            await raw.kv.get(b"\x00", range_end=b"\x00", revision=revision, count_only=True)
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.OUT_OF_RANGE, exc
            assert "compacted" in (exc.details() or ""), exc
            return False
    return True


@pytest.fixture
async def store(etcd_server: EtcdServer | ExternalEtcd,
                etcd_prefix: str) -> AsyncIterator[EtcdStore]:
    s = await EtcdStore.open([etcd_server.endpoint], etcd_prefix, timeout=2.0)
    try:
        yield s
    finally:
        await s.close()


async def test_the_leader_compacts_to_the_revision_it_saw_one_interval_earlier(
    store: EtcdStore, etcd_server: EtcdServer | ExternalEtcd
) -> None:
    clock, seen, leading = Clock(), [0], [True]
    compactor = Compactor(store, lambda: leading[0], lambda: seen[0], INTERVAL, clock)
    seen[0] = await store.put("nodes/n1", b"beat 1")
    noted = seen[0]
    assert await compactor.step() == 0  # a leader notes before it compacts
    seen[0] = await store.put("nodes/n1", b"beat 2")
    clock.now += INTERVAL - 1
    assert await compactor.step() == 0  # not one interval yet
    assert await readable_at(etcd_server.endpoint, noted - 1)

    clock.now += 1
    assert await compactor.step() == noted
    assert not await readable_at(etcd_server.endpoint, noted - 1)
    assert await readable_at(etcd_server.endpoint, noted)  # the interval kept
    assert (await store.get("nodes/n1")) is not None

    # The next pass compacts to what the last one noted, one interval later.
    later = seen[0]
    seen[0] = await store.put("nodes/n1", b"beat 3")
    clock.now += INTERVAL
    assert await compactor.step() == later
    assert not await readable_at(etcd_server.endpoint, later - 1)


async def test_only_a_leader_compacts_and_a_new_one_waits_an_interval(
    store: EtcdStore, etcd_server: EtcdServer | ExternalEtcd
) -> None:
    clock, seen, leading = Clock(), [0], [False]
    compactor = Compactor(store, lambda: leading[0], lambda: seen[0], INTERVAL, clock)
    seen[0] = await store.put("nodes/n1", b"beat 1")
    first = seen[0]
    for _ in range(3):
        clock.now += INTERVAL
        assert await compactor.step() == 0
    leading[0] = True
    assert await compactor.step() == 0  # notes now; compacts one interval later
    seen[0] = await store.put("nodes/n1", b"beat 2")
    leading[0] = False  # lost the lead: what it noted is forgotten
    clock.now += INTERVAL
    assert await compactor.step() == 0
    leading[0] = True
    assert await compactor.step() == 0
    assert await readable_at(etcd_server.endpoint, first)
    clock.now += INTERVAL
    assert await compactor.step() == seen[0]

    off = Compactor(store, lambda: True, lambda: seen[0] + 10, 0.0, clock)
    for _ in range(3):
        clock.now += INTERVAL
        assert await off.step() == 0  # LLMGW_ETCD_COMPACTION_INTERVAL=0: never


async def test_a_compaction_etcd_cannot_take_is_done_at_the_next_pass(
    own_etcd: EtcdServer, etcd_prefix: str
) -> None:
    store = await EtcdStore.open([own_etcd.endpoint], etcd_prefix, timeout=1.0)
    try:
        clock, seen = Clock(), [0]
        compactor = Compactor(store, lambda: True, lambda: seen[0], INTERVAL, clock)
        seen[0] = await store.put("nodes/n1", b"beat 1")
        await compactor.step()
        seen[0] = await store.put("nodes/n1", b"beat 2")
        own_etcd.pause()
        try:
            clock.now += INTERVAL
            with pytest.raises(StoreUnavailable):
                await compactor.step()
        finally:
            own_etcd.resume()
        clock.now += INTERVAL
        assert await compactor.step() == seen[0]
        assert not await readable_at(own_etcd.endpoint, seen[0] - 1)
    finally:
        await store.close()


async def test_gateways_follow_writes_across_compactions(
    own_etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """Three gateways compacting every 0.5 s: the leader's compactions move
    etcd's compacted revision on, and every mirror keeps following the
    catalog edits made on another gateway meanwhile."""
    async with gateways(own_etcd, etcd_prefix, tmp_path, 3,
                        etcd_compaction_interval=0.5) as gws:
        (app0, admin0), *others = gws
        first = app0.state.gateway.mirror.revision
        body = {"model": "org/w", "gpus": 1, "replicas": {"min": 0, "max": 1}, "idle_timeout": 600}
        for i in range(6):
            r = await admin0.put("/admin/models/m", json={**body, "aliases": [f"a{i}"]})
            assert r.status_code < 300, r.text
            for app, _ in others:
                await until(lambda a=app, i=i: a.state.gateway.table.resolve(f"a{i}") == "m",
                            f"alias a{i} on {app.state.gateway.settings.gateway_id}")
            if i % 2:
                # A compaction past this edit before the next one.
                await compacted_past(own_etcd.endpoint, app0.state.gateway.mirror.revision)
        assert not await readable_at(own_etcd.endpoint, first)


async def compacted_past(endpoint: str, revision: int, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await readable_at(endpoint, revision - 1):
        assert loop.time() < deadline, f"no compaction past revision {revision}"
        await asyncio.sleep(0.1)
