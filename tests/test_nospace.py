"""etcd out of space (its NOSPACE alarm) is said as such, not as a store
that cannot be reached: by the store's health, /readyz, writes' 503s and
`llmgw_store_nospace`; and the documented way out (compact, defragment,
disarm) brings writes back (docs/design/security-operations.md, "A month of uptime").

On an etcd of this test's own with a tiny `--quota-backend-bytes`, filled
until the alarm fires."""

from __future__ import annotations

from pathlib import Path

import pytest
from etcd3aio import Etcd3Client
from etcd3aio.maintenance import AlarmType

from app.store.base import StoreFull
from app.store.etcd.store import EtcdStore
from tests.support.etcd import EtcdServer, throwaway_etcd
from tests.support.procs import until
from tests.test_agent_api import gateways

QUOTA = 8 * 1024 * 1024
FILLER = b"x" * (256 * 1024)


async def fill(store: EtcdStore) -> int:
    """Puts filler keys until etcd refuses one for lack of space."""
    for i in range(200):
        try:
            await store.put(f"filler/{i}", FILLER)
        except StoreFull:
            return i
    raise AssertionError(f"{200 * len(FILLER)} bytes written, no NOSPACE alarm")


async def nospace_alarmed(endpoint: str) -> bool:
    async with Etcd3Client([endpoint]) as raw:
        assert raw.maintenance is not None
        alarms = (await raw.maintenance.alarms()).alarms
    return any(a.alarm == AlarmType.NOSPACE for a in alarms)


async def free_space(endpoint: str, store: EtcdStore, written: int) -> None:
    """The procedure in the docs: delete what filled it, compact,
    defragment, disarm (etcdctl's calls, made through the client)."""
    for i in range(written):
        await store.delete(f"filler/{i}")
    async with Etcd3Client([endpoint]) as raw:
        assert raw.kv is not None
        revision = (await raw.kv.get(b"\x00", range_end=b"\x00", count_only=True)).header
        await raw.kv.compact(revision.revision, physical=True)
        assert raw.maintenance is not None
        await raw.maintenance.defragment()
        # As `etcdctl alarm disarm`: each alarm, by the member that raised it.
        for alarm in (await raw.maintenance.alarms()).alarms:
            await raw.maintenance.alarm_deactivate(AlarmType(alarm.alarm),
                                                   member_id=alarm.memberID)


@pytest.fixture
def tiny_etcd(tmp_path: Path) -> EtcdServer:
    with throwaway_etcd(tmp_path, flags=["--quota-backend-bytes", str(QUOTA)]) as server:
        yield server  # type: ignore[misc]


async def test_a_full_etcd_is_reported_as_out_of_space_and_recovers(
    tiny_etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    async with gateways(tiny_etcd, etcd_prefix, tmp_path, 1) as [(app, admin)]:
        gw = app.state.gateway
        store = await EtcdStore.open([tiny_etcd.endpoint], etcd_prefix + "fill/", timeout=2.0)
        try:
            written = await fill(store)
            assert await nospace_alarmed(tiny_etcd.endpoint)
            assert store.health().state == "nospace"
            assert "space exceeded" in store.health().reason
            assert await store.get("filler/0") is not None  # reads still work ...
            assert store.health().state == "nospace"  # ... and do not end it

            body = {"model": "org/w", "gpus": 1, "replicas": {"min": 0, "max": 1},
                    "idle_timeout": 600}
            r = await admin.put("/admin/models/m", json=body)
            assert r.status_code == 503, r.text
            problem = r.json()
            assert problem["title"] == "State store out of space"
            assert "cannot be reached" not in problem["detail"]
            for words in ("out of space", "etcdctl defrag", "etcdctl alarm disarm"):
                assert words in problem["detail"], problem
            ready = (await admin.get("/readyz")).json()
            assert ready["status"] == "ready"  # routing goes on from the mirror
            assert ready["store"].startswith("out of space: "), ready
            assert "etcdctl alarm disarm" in ready["store"]
            metrics = (await admin.get("/metrics")).text
            assert "llmgw_store_nospace 1.0" in metrics

            await free_space(tiny_etcd.endpoint, store, written)
            assert not await nospace_alarmed(tiny_etcd.endpoint)
            # The gateway learns it from its next renewal, without a write.
            await until(lambda: gw.store.health().state == "reachable", "space back", 5.0)
            assert (await admin.get("/readyz")).json()["store"] == "ok"
            assert "llmgw_store_nospace 0.0" in (await admin.get("/metrics")).text
            r = await admin.put("/admin/models/m", json=body)
            assert r.status_code < 300, r.text
            await store.put("after", b"1")  # a write that succeeds ends it too
            assert store.health().state == "reachable"
        finally:
            await store.close()
