"""bench/control_scale.py's catalog edits: three `llmgw serve` processes on a
real etcd preloaded with a catalog and a fleet; an alias change PUT on the
first, timed from the PUT's answer until both others list the alias
(`GET /v1/models/{alias}` answers 200: the edit went etcd -> their mirror's
watch -> their publisher -> their router's table).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from peers import Process, free_port, http, wait_for  # noqa: E402

POLL_S = 0.005


def gateway_env(i: int, port: int, etcd: str, prefix: str, secret: str, admin: str,
                data: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    return env | {
        "LLMGW_ETCD_ENDPOINTS": etcd, "LLMGW_ETCD_PREFIX": prefix, "LLMGW_SECRET": secret,
        "LLMGW_ADMIN_TOKEN": admin, "LLMGW_GATEWAY_ID": f"scale-gw{i}",
        "LLMGW_PORT": str(port), "LLMGW_DATA_DIR": str(data / f"gw{i}"),
        "LLMGW_LOCAL_AGENT": "false", "LLMGW_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1",
        # One process each, as the other benchmarks' gateways: the default
        # (the cores) ran six processes on this 2-core machine, each with
        # its own mirror and engine-load polls.
        "LLMGW_WORKERS": "1"}


class Gateways:
    """`count` gateway processes on `etcd`; `stop()` ends them by id."""

    def __init__(self, tmp: Path, etcd: str, prefix: str, count: int = 3,
                 env: dict[str, str] | None = None) -> None:
        self.secret = "bench-secret-" + secrets.token_hex(16)
        self.admin = "bench-admin-" + secrets.token_hex(16)
        self.urls: list[str] = []
        self.procs: list[Process] = []
        for i in range(count):
            port = free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            self.procs.append(Process(
                f"gw{i}", [sys.executable, "-m", "app.cli", "serve"], tmp / f"gw{i}.log",
                env=gateway_env(i, port, etcd, prefix, self.secret, self.admin, tmp)
                | (env or {})).start())

    def wait_ready(self, timeout: float = 180.0) -> None:
        for url, proc in zip(self.urls, self.procs, strict=True):
            wait_for(lambda u=url: http("GET", u + "/readyz")[0] == 200,  # type: ignore[misc]
                     timeout, f"{proc.name} ready", proc.alive)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


async def _until(check: Callable[[], Awaitable[bool]], what: str,
                 timeout: float = 60.0) -> None:
    deadline = time.perf_counter() + timeout
    while not await check():
        if time.perf_counter() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


async def time_edits(gws: Gateways, count: int) -> list[float]:
    """Milliseconds from each PUT's answer on the first gateway until both
    others list the new alias."""
    import httpx

    status, body = http("POST", gws.urls[0] + "/admin/keys", {"name": "scale"}, gws.admin)
    if status != 201:
        raise SystemExit(f"POST /admin/keys: {status} {body}")
    key = str(body["key"])
    name = "org/edited"
    spec: dict[str, Any] = {"model": "org/edited-weights", "gpus": 1,
                            "replicas": {"min": 0, "max": 1}, "idle_timeout": 600}
    async with httpx.AsyncClient(timeout=30.0) as client:
        admin = {"Authorization": f"Bearer {gws.admin}"}
        user = {"Authorization": f"Bearer {key}"}

        async def put(aliases: list[str]) -> None:
            resp = await client.put(f"{gws.urls[0]}/admin/models/{name}", headers=admin,
                                    json={**spec, "aliases": aliases})
            if resp.status_code >= 300:
                raise SystemExit(f"PUT failed: {resp.status_code} {resp.text}")

        async def listed(ident: str) -> bool:
            answers = await asyncio.gather(*(
                client.get(f"{url}/v1/models/{ident}", headers=user) for url in gws.urls[1:]))
            return all(a.status_code == 200 for a in answers)

        await put([])
        await _until(lambda: listed(name), f"{name} on the other gateways")
        times: list[float] = []
        for i in range(count):
            alias = f"edited-alias-{i}"
            await put([alias])
            start = time.perf_counter()

            async def watch(url: str, a: str = alias, began: float = start) -> None:
                while True:
                    resp = await client.get(f"{url}/v1/models/{a}", headers=user)
                    if resp.status_code == 200:
                        return
                    if time.perf_counter() - began > 60:
                        raise SystemExit(f"{a} not on {url} within 60 s")
                    await asyncio.sleep(POLL_S)

            await asyncio.gather(*(watch(url) for url in gws.urls[1:]))
            times.append((time.perf_counter() - start) * 1000)
    return times


async def edits(count: int, preload: Callable[[str, str], Awaitable[str]]) -> list[float]:
    """`preload(endpoint, prefix)` fills etcd first and says what it put."""
    from etcd_server import EtcdServer, find_etcd_binary

    binary = find_etcd_binary()
    if binary is None:
        raise SystemExit("no etcd binary (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="control-edits-") as tmp_name:
        tmp = Path(tmp_name)
        server = EtcdServer(binary, tmp / "etcd" / "data")
        server.start()
        prefix = "/scale/"
        gws: Gateways | None = None
        try:
            start = time.perf_counter()
            what = await preload(server.endpoint, prefix)
            print(f"edit  preloaded {what} in {time.perf_counter() - start:.1f} s", flush=True)
            gws = Gateways(tmp, server.endpoint, prefix)
            gws.wait_ready()
            return await time_edits(gws, count)
        finally:
            if gws is not None:
                gws.stop()
            server.stop()


async def preload(endpoint: str, prefix: str, f: Any) -> None:
    """The fleet's state in etcd (`f`: a control_fleet.Fleet), 100 keys per
    transaction."""
    from app.control import state as s
    from app.store.base import Put
    from app.store.etcd.store import EtcdStore

    store = await EtcdStore.open([endpoint], prefix)
    try:
        puts: list[Put] = []
        for name, spec in f.models.items():
            puts.append(Put(s.MODELS + name, spec.model_dump_json().encode()))
        for name, info in f.nodes.items():
            # The nodes' own address: their statuses' URLs must be on it.
            # Their agents' API on a closed port, as agents report one: each
            # gateway asks each node for its engines' loads once a second
            # (refused at once here), not each engine (2,000 reads a second
            # per gateway, most of the edit figure's CPU before 2026-12-02).
            puts.append(Put(s.NODES + name, info.model_copy(
                update={"address": "127.0.0.1", "api_url": "http://127.0.0.1:9"}
            ).model_dump_json().encode()))
        for rid, r in f.replicas.items():
            puts.append(Put(s.REPLICAS + rid, r.model_dump_json().encode()))
            # A closed loopback port: an engine load poll is refused at once
            # rather than waiting out a connect to an address nobody has.
            st = f.statuses[rid].model_copy(update={"url": "http://127.0.0.1:9"})
            puts.append(Put(s.STATUS + rid, st.model_dump_json().encode()))
        for i in range(0, len(puts), 100):
            res = await store.txn([], puts[i:i + 100])
            if not res.succeeded:
                raise SystemExit("preloading the fleet failed")
    finally:
        await store.close()
