"""NaN and infinities, which Python's JSON parser and FastAPI's query
parsing accept, are refused where they would change a meaning: a long poll
left without a deadline, a key meant to expire that never does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx

from app.gateway.main import GatewayApp, create_app
from app.gateway.settings import Settings
from app.wire.tokens import node_token
from tests.support.procs import until

SECRET = "finite-secret-0123456789"
ADMIN = "finite-admin-0123456789"


@asynccontextmanager
async def gateway(tmp: Path, token: str) -> AsyncIterator[tuple[GatewayApp, httpx.AsyncClient]]:
    app = create_app(Settings(secret=SECRET, admin_token=ADMIN, data_dir=tmp,
                              local_agent=False, port=19010))
    await app.state.gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     headers={"Authorization": f"Bearer {token}"}) as c:
            await until(lambda: app.state.gateway.ready, "state loaded")
            yield app, c
    finally:
        await app.state.gateway.stop()


async def test_a_long_poll_s_wait_must_be_a_finite_number(tmp_path: Path) -> None:
    """`wait=nan` passed min/max unclamped, and the poll had no deadline."""
    async with gateway(tmp_path, node_token(SECRET, "n1")) as (_, c):
        url = "/agent/v1/nodes/n1/assignments"
        fp = (await c.get(url)).json()["fingerprint"]
        for wait in ("nan", "inf", "-inf"):
            r = await asyncio.wait_for(c.get(url, params={"since": fp, "wait": wait}), 5)
            assert r.status_code == 422, (wait, r.text)
            assert r.json()["errors"][0]["loc"] == ["query", "wait"]
        started = time.monotonic()
        r = await c.get(url, params={"since": fp, "wait": "0.2"})
        assert r.status_code == 200 and r.json()["fingerprint"] == fp
        assert 0.15 < time.monotonic() - started < 3


async def test_a_key_s_expiry_must_be_a_finite_number(tmp_path: Path) -> None:
    """`"expires": NaN` made a key that never expires (stored as null)."""
    async with gateway(tmp_path, ADMIN) as (_, c):
        for body in ('{"name": "a", "expires": NaN}', '{"name": "b", "expires": Infinity}',
                     '{"name": "c", "expires_in": Infinity}'):
            r = await c.post("/admin/keys", content=body,
                             headers={"content-type": "application/json"})
            assert r.status_code == 422, (body, r.text)
            assert r.json()["errors"][0]["loc"][:1] == ["body"], r.text
        assert (await c.get("/admin/keys")).json() == []
        r = await c.post("/admin/keys", json={"name": "d", "expires_in": 60})
        assert r.status_code == 201 and r.json()["expires"] > time.time()


async def test_a_node_s_report_with_a_number_that_is_not_finite_is_a_422(
        tmp_path: Path) -> None:
    """A heartbeat's or a status report's NaN or infinity (memory, utilization,
    a status's time) is refused whole, as a problem naming the field; the
    node as stored keeps its last good report."""
    async with gateway(tmp_path, node_token(SECRET, "n1")) as (app, c):
        url = "/agent/v1/nodes/n1"
        good = {"name": "n1", "cpus": 4, "memory_mib": 1024, "gpus": [
            {"index": 0, "memory_mib": 81920, "memory_free_mib": 1000, "utilization": 5}]}
        r = await c.put(url, json=good)
        assert r.status_code == 200, r.text
        for bad in ("NaN", "Infinity", "-Infinity"):
            for where in ('"memory_mib": X', '"cpus": X',
                          '"gpus": [{"index": 0, "memory_mib": X}]',
                          '"gpus": [{"index": 0, "utilization": X}]',
                          '"gpus": [{"index": 0, "memory_free_mib": X}]'):
                body = '{"name": "n1", ' + where.replace("X", bad) + "}"
                r = await c.put(url, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 422, (body, r.text)
                assert r.headers["content-type"].startswith("application/problem+json")
            body = ('{"replicas": [{"id": "r1", "node": "n1", "phase": "ready", '
                    f'"updated": {bad}}}]}}')
            r = await c.put(url + "/status", content=body,
                            headers={"content-type": "application/json"})
            assert r.status_code == 422, (body, r.text)
            assert r.json()["errors"][0]["loc"][-1] == "updated", r.text
        mirror = app.state.gateway.mirror
        await until(lambda: "n1" in mirror.nodes(), "the node mirrored")
        node = mirror.nodes()["n1"]
        assert node.memory_mib == 1024 and node.gpus[0].utilization == 5
