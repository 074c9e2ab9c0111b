"""A client key write whose answer is lost
(docs/design/security-operations.md, "Writes whose outcome is unknown"): the
write reaches etcd and is applied,
and its answer is held back past LLMGW_ETCD_TIMEOUT by a proxy in front of
this test's own etcd. The key must then be shown (the read after the write
finds it) or, when even that read goes unanswered, be revoked once the
store answers and named in the 503: never a saved key nobody saw."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.control import state as s
from app.store.etcd.store import EtcdStore
from tests.support.etcd import EtcdServer
from tests.support.holding_proxy import HoldingProxy
from tests.support.procs import Cluster, GatewayProc, wait_for

TIMEOUT = 2.0  # the gateway's LLMGW_ETCD_TIMEOUT


@pytest.fixture
def held(own_etcd: EtcdServer, etcd_prefix: str, tmp_path: Path
         ) -> Iterator[tuple[GatewayProc, HoldingProxy, EtcdServer]]:
    proxy = HoldingProxy(own_etcd.endpoint).start()
    cluster = Cluster(tmp_path, proxy.endpoint, etcd_prefix)
    try:
        yield cluster.gateway("gw-a", etcd_timeout=str(TIMEOUT)), proxy, own_etcd
    finally:
        cluster.close()
        proxy.stop()


def stored_key_ids(etcd: EtcdServer, prefix: str) -> set[str]:
    """The client key records in etcd itself, not through the gateway."""
    async def read() -> set[str]:
        store = await EtcdStore.open([etcd.endpoint], prefix=prefix)
        try:
            got = await store.range(s.KEYS)
            return {s.ClientKey.model_validate_json(kv.value).id for kv in got.kvs}
        finally:
            await store.close()

    return asyncio.run(read())


def create_held_for(gw: GatewayProc, proxy: HoldingProxy, seconds: float) -> httpx.Response:
    """POST /admin/keys with every answer from etcd held for `seconds`."""
    out: list[Any] = []
    proxy.hold()
    try:
        poster = threading.Thread(target=lambda: out.append(
            gw.admin().post("/admin/keys", json={"name": "held"})))
        poster.start()
        time.sleep(seconds)
    finally:
        proxy.release()
    poster.join(30)
    return out[0]  # type: ignore[no-any-return]


def test_a_key_saved_though_its_answer_was_lost_is_shown(
    held: tuple[GatewayProc, HoldingProxy, EtcdServer], etcd_prefix: str,
) -> None:
    gw, proxy, etcd = held
    # The write's answer is lost (its deadline passes at ~2 s); the read
    # after it is answered once released, at 3 s, within its own deadline.
    r = create_held_for(gw, proxy, 1.5 * TIMEOUT)
    assert r.status_code == 201, r.text
    created = r.json()
    assert stored_key_ids(etcd, etcd_prefix) == {created["id"]}
    # The key shown is the key saved: the gateway lets it through.
    wait_for(lambda: httpx.get(gw.url + "/v1/models", timeout=5, headers={
        "Authorization": f"Bearer {created['key']}"}).status_code == 200, 10, "key accepted")


def test_a_key_whose_outcome_stays_unknown_is_named_and_revoked(
    held: tuple[GatewayProc, HoldingProxy, EtcdServer], etcd_prefix: str,
) -> None:
    gw, proxy, etcd = held
    # Neither the write nor the read after it is answered in time.
    r = create_held_for(gw, proxy, 2.75 * TIMEOUT)
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["title"] == "Outcome unknown" and "key" not in body
    assert body["id"] in body["detail"]
    # It was saved (the write reached etcd), and is revoked once etcd answers.
    wait_for(lambda: stored_key_ids(etcd, etcd_prefix) == set(), 10, "the unseen key revoked")
    assert gw.admin().get(f"/admin/keys/{body['id']}").status_code == 404
    gw.logged("its key was never shown")  # the revocation
