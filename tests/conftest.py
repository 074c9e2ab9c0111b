"""Shared fixtures. Logic lives in tests/support/; keep this file a list."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from app.control.mirror import Mirror
from app.store.embedded import EmbeddedStore
from tests.support.etcd import EtcdFixture, EtcdServer, ExternalEtcd, throwaway_etcd
from tests.support.procs import Cluster
from tests.support.proxy_rig import Rig, started
from tests.support.real_vllm import RealFleet, real_fleet


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer | ExternalEtcd]:
    """One etcd for the whole run (or LLMGW_TEST_ETCD); `.endpoint` is "host:port"."""
    fixture = EtcdFixture()
    try:
        yield fixture.start()
    finally:
        fixture.stop()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, for tests that stop, pause or kill it:
    doing that to `etcd_server` would break the tests sharing it. Never
    skipped for LLMGW_TEST_ETCD; under CI=true a missing etcd fails."""
    with throwaway_etcd(tmp_path) as server:
        yield server


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    """Real vLLM engines (its CPU build) started by our agents, behind two
    gateways on an etcd of their own: started on first use, shared by
    tests/test_vllm_contract.py and tests/test_vllm_real.py (which sort
    last but a few, so the engines idle through little of the run)."""
    with real_fleet(tmp_path_factory.mktemp("real-vllm")) as fleet:
        yield fleet


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix of this test's own, so tests can share one etcd."""
    return f"/llmgw-test-{uuid.uuid4().hex}/"


@pytest.fixture
def cluster(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> Iterator[Cluster]:
    """Real gateway and agent processes on the shared etcd, killed at teardown."""
    c = Cluster(tmp_path, etcd_server.endpoint, etcd_prefix)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def solo(tmp_path: Path) -> Iterator[Cluster]:
    """Like `cluster`, but for gateways alone on the embedded store."""
    c = Cluster(tmp_path, None, "")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedStore, Mirror]]:
    """An embedded store and a running mirror of it, for in-process tests."""
    store = await EmbeddedStore.open(tmp_path / "state.db", expiry_interval=None)
    mirror = Mirror(store)
    mirror.start()
    try:
        yield store, mirror
    finally:
        await mirror.stop()
        await store.close()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """The in-process router rig (tests/support/proxy_rig.py), its proxy started."""
    async with started(Rig()) as r:
        yield r
