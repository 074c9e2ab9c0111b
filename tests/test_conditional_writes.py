"""Conditional catalog writes (If-Match, If-None-Match) and write deadlines
(X-Request-Deadline, LLMGW_ADMIN_WRITE_DEADLINE), in-process on the
embedded store (docs/design/admin-writes.md, "Catalog writes")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.gateway.gateway import Gateway
from tests.test_catalog import client, settings, started
from tests.test_fleet_api import _add_node

SPEC: dict[str, Any] = {"model": "acme/m", "gpus": 1, "replicas": {"min": 0, "max": 0}}


async def gateway(tmp: Path, **kw: Any) -> tuple[httpx.AsyncClient, Gateway]:
    app, gw = await started(settings(tmp, "gw-cond", **kw))
    return client(app), gw


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    c, g = await gateway(tmp_path)
    try:
        yield c, g
    finally:
        await c.aclose()
        await g.stop()


async def etag_of(c: httpx.AsyncClient, name: str) -> str:
    r = await c.get(f"/admin/models/{name}")
    assert r.status_code == 200, r.text
    return r.headers["etag"]


async def test_a_put_with_the_etag_read_applies_and_a_stale_one_is_412(
        gw: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, _ = gw
    assert (await c.put("/admin/models/m", json=SPEC)).status_code == 201
    first = await etag_of(c, "m")
    assert first.startswith('"') and first.endswith('"'), first

    r = await c.put("/admin/models/m", json=SPEC | {"gpus": 2}, headers={"If-Match": first})
    assert r.status_code == 200, r.text
    second = await etag_of(c, "m")
    assert second != first

    # Written with the first ETag, read before the edit above: refused, nothing written.
    r = await c.put("/admin/models/m", json=SPEC | {"gpus": 4}, headers={"If-Match": first})
    assert r.status_code == 412, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["etag"] == second and second in r.json()["detail"]
    assert r.headers["etag"] == second  # the current revision, as a header too
    assert (await c.get("/admin/models/m")).json()["gpus"] == 2
    assert await etag_of(c, "m") == second

    # A model that is not there matches no ETag (and If-Match: * needs it to be there).
    for tag in (first, "*"):
        r = await c.put("/admin/models/other", json=SPEC, headers={"If-Match": tag})
        assert r.status_code == 412, r.text
    assert (await c.get("/admin/models/other")).status_code == 404
    listed = {m["name"]: m["etag"] for m in (await c.get("/admin/models")).json()}
    assert listed == {"m": second}


async def test_a_delete_with_a_stale_etag_is_412_and_with_the_current_one_deletes(
        gw: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, _ = gw
    assert (await c.put("/admin/models/m", json=SPEC)).status_code == 201
    first = await etag_of(c, "m")
    assert (await c.put("/admin/models/m", json=SPEC | {"gpus": 2})).status_code == 200
    r = await c.delete("/admin/models/m", headers={"If-Match": first})
    assert r.status_code == 412, r.text
    assert (await c.get("/admin/models/m")).status_code == 200
    r = await c.delete("/admin/models/m", headers={"If-Match": await etag_of(c, "m")})
    assert r.status_code == 204, r.text
    assert (await c.get("/admin/models/m")).status_code == 404


async def test_if_none_match_star_only_creates(gw: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, _ = gw
    star = {"If-None-Match": "*"}
    assert (await c.put("/admin/models/m", json=SPEC, headers=star)).status_code == 201
    r = await c.put("/admin/models/m", json=SPEC | {"gpus": 3}, headers=star)
    assert r.status_code == 412, r.text
    assert r.json()["etag"] == await etag_of(c, "m")
    assert (await c.get("/admin/models/m")).json()["gpus"] == 1
    r = await c.put("/admin/models/m", json=SPEC, headers={"If-Match": "not-quoted"})
    assert r.status_code == 400, r.text


async def test_of_two_writes_conditioned_on_the_same_etag_one_wins(
        gw: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, _ = gw
    assert (await c.put("/admin/models/m", json=SPEC)).status_code == 201
    tag = await etag_of(c, "m")
    # Each round's two specs differ from the one stored: a put of the spec
    # as stored writes nothing and holds at that ETag (it comes first), so
    # both would answer 200 (the flake of round 2, whose stored spec was
    # one of the two).
    for i in range(3):
        x, y = 4 + 2 * i, 5 + 2 * i
        a, b = await asyncio.gather(
            c.put("/admin/models/m", json=SPEC | {"gpus": x}, headers={"If-Match": tag}),
            c.put("/admin/models/m", json=SPEC | {"gpus": y}, headers={"If-Match": tag}))
        assert sorted([a.status_code, b.status_code]) == [200, 412], (a.text, b.text)
        winner = x if a.status_code == 200 else y
        assert (await c.get("/admin/models/m")).json()["gpus"] == winner
        tag = await etag_of(c, "m")


async def test_a_write_past_its_clients_deadline_is_refused_and_writes_nothing(
        gw: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, _ = gw
    gone = {"X-Request-Deadline": f"{time.time() - 1:.3f}"}
    r = await c.put("/admin/models/m", json=SPEC, headers=gone)
    assert r.status_code == 408, r.text
    assert "nothing written" in r.json()["detail"]
    assert (await c.get("/admin/models/m")).status_code == 404
    later = {"X-Request-Deadline": f"{time.time() + 30:.3f}"}
    assert (await c.put("/admin/models/m", json=SPEC, headers=later)).status_code == 201
    assert (await c.delete("/admin/models/m", headers=gone)).status_code == 408
    assert (await c.get("/admin/models/m")).status_code == 200
    r = await c.put("/admin/models/m", json=SPEC, headers={"X-Request-Deadline": "soon"})
    assert r.status_code == 400, r.text


async def test_a_write_received_longer_ago_than_the_servers_bound_is_refused(
        tmp_path: Path) -> None:
    c, gw = await gateway(tmp_path, admin_write_deadline=0.5)
    try:
        async def slow_body() -> AsyncIterator[bytes]:
            # The headers are in (the request was received); its body comes late.
            yield b'{"model": "acme/m", '
            await asyncio.sleep(1.0)
            yield b'"gpus": 1}'

        r = await c.put("/admin/models/m", content=slow_body(),
                        headers={"Content-Type": "application/json"})
        assert r.status_code == 408, r.text
        assert "LLMGW_ADMIN_WRITE_DEADLINE" in r.json()["detail"]
        assert (await c.get("/admin/models/m")).status_code == 404
        assert (await c.put("/admin/models/m", json=SPEC)).status_code == 201
    finally:
        await c.aclose()
        await gw.stop()


async def test_node_conf_and_quota_writes_take_if_match_and_deadlines(
        gw: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, g = gw
    await _add_node(g, "n1")
    r = await c.get("/admin/nodes/n1/conf")
    assert r.status_code == 200 and "etag" not in r.headers  # none stored yet
    r = await c.put("/admin/nodes/n1/conf", json={"pool": "a"}, headers={"If-None-Match": "*"})
    assert r.status_code == 200, r.text
    first = r.headers["etag"]
    assert (await c.get("/admin/nodes/n1/conf")).headers["etag"] == first
    assert (await c.post("/admin/nodes/n1/cordon")).status_code == 200
    r = await c.put("/admin/nodes/n1/conf", json={"pool": "b"}, headers={"If-Match": first})
    assert r.status_code == 412, r.text
    now = (await c.get("/admin/nodes/n1/conf")).headers["etag"]
    assert r.json()["etag"] == now and r.headers["etag"] == now
    conf = (await c.get("/admin/nodes/n1/conf")).json()
    assert (conf["pool"], conf["cordoned"]) == ("a", True)
    r = await c.put("/admin/nodes/n1/conf", json={"pool": "b"}, headers={"If-Match": now})
    assert r.status_code == 200 and r.json()["pool"] == "b", r.text

    r = await c.put("/admin/quotas/team", json={"max_gpus": 4})
    assert r.status_code == 200, r.text
    tag = r.headers["etag"]
    assert [q["etag"] for q in (await c.get("/admin/quotas")).json()] == [tag]
    r = await c.put("/admin/quotas/team", json={"max_gpus": 8}, headers={"If-None-Match": "*"})
    assert r.status_code == 412, r.text
    assert r.headers["etag"] == tag == r.json()["etag"]
    gone = {"X-Request-Deadline": f"{time.time() - 1:.3f}"}
    assert (await c.delete("/admin/quotas/team", headers=gone)).status_code == 408
    assert (await c.put("/admin/quotas/team", json={"max_gpus": 2},
                        headers=gone)).status_code == 408
    assert (await c.get("/admin/quotas")).json()[0]["max_gpus"] == 4
    assert (await c.delete("/admin/quotas/team", headers={"If-Match": tag})).status_code == 204


async def test_client_key_writes_past_their_deadline_are_refused(
        gw: tuple[httpx.AsyncClient, Gateway]) -> None:
    c, _ = gw
    gone = {"X-Request-Deadline": f"{time.time() - 1:.3f}"}
    r = await c.post("/admin/keys", json={"name": "late"}, headers=gone)
    assert r.status_code == 408, r.text
    assert (await c.get("/admin/keys")).json() == []
    r = await c.post("/admin/keys", json={"name": "k"})
    assert r.status_code == 201, r.text
    assert (await c.delete(f"/admin/keys/{r.json()['id']}", headers=gone)).status_code == 408
    assert [k["name"] for k in (await c.get("/admin/keys")).json()] == ["k"]
