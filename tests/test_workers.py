"""`llmgw serve --workers 2` on one etcd (docs/design/workers.md):
real processes, the vLLM stand-in in-process as an external model's
provider. Requests on new connections spread over both workers (the access
line names its worker); a key's limits hold across them (L + N - 1, each
worker a gateway in the key-shares scheme); a SIGKILLed worker loses only
its own streams and is restarted; `llmgw stop` ends both, open streams
complete; one leader among the workers of two gateways."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme

from tests.fakes.fake_vllm import FakeVLLM
from tests.support.procs import ADMIN, ROOT, Cluster, GatewayProc, free_port, wait_for
from tests.test_keys import stand_in

MESSAGES: Any = [{"role": "user", "content": "hi"}]
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def worker_pids(gw: GatewayProc) -> dict[int, int]:
    """Worker index -> pid, of the live workers of `gw`'s supervisor."""
    assert gw.popen is not None
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or "--supervisor" not in args:
            continue
        if args[args.index("--supervisor") + 1] == str(gw.popen.pid):
            found[int(args[args.index("--worker") + 1])] = int(proc.name)
    return found


def _local_port(r: httpx.Response) -> int:
    return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])


def asked(gw: GatewayProc, path: str) -> tuple[str, httpx.Response]:
    """`path` asked on a new connection, and the worker that took it (its
    index): a /v1/models request goes first on the same connection,
    refused for want of a key, and its access line names the worker."""
    rid = f"who-{uuid.uuid4().hex}"
    with httpx.Client(base_url=gw.url, timeout=5, verify=gw.verify) as c:
        probe = c.get("/v1/models", headers={"X-Request-Id": rid})
        r = c.get(path, headers=AUTH)
        assert probe.status_code == 401 and _local_port(probe) == _local_port(r), (
            "both on one connection")
    # Written by a thread, after the answer.
    (worker,) = wait_for(lambda: access_workers(gw, rid), 10, "the access line")
    return worker, r


def seen_workers(gw: GatewayProc, ids: set[str], tries: int = 60) -> set[str]:
    """Which of `ids` (worker indexes) answer new connections within
    `tries` of them."""
    seen: set[str] = set()
    for _ in range(tries):
        with contextlib.suppress(httpx.HTTPError):
            worker, r = asked(gw, "/healthz")
            if r.status_code == 200:
                seen.add(worker)
        if seen >= ids:
            break
    return seen


def access_workers(gw: GatewayProc, request_id: str) -> list[str]:
    """The worker named on the access lines of `request_id`."""
    return re.findall(rf"app\.access: .*request_id={re.escape(request_id)} .*worker=(\d+)",
                      gw.output())


@dataclass
class Rig:
    gw: GatewayProc
    fake: FakeVLLM
    free: str  # a client key without limits

    async def chat(self, key: str, rid: str, stream: bool = False) -> int | str:
        """One request on a new connection: a plain answer's status, or a
        stream's end: "done" ([DONE] read), "cut" (the connection broke) or
        the status it was refused with."""
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": rid}
        body = {"model": "m", "messages": MESSAGES, "stream": stream}
        async with httpx.AsyncClient(timeout=60) as http:
            if not stream:
                return (await http.post(self.gw.url + "/v1/chat/completions", headers=headers,
                                        json=body)).status_code
            try:
                async with http.stream("POST", self.gw.url + "/v1/chat/completions",
                                       headers=headers, json=body) as r:
                    if r.status_code != 200:
                        return r.status_code
                    text = "".join([chunk async for chunk in r.aiter_text()])
            except httpx.HTTPError:
                return "cut"
            return "done" if "data: [DONE]" in text else "cut"

    async def key(self, **limits: int) -> dict[str, Any]:
        async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
            r = await http.post(self.gw.url + "/admin/keys",
                                json={"name": "k", "limits": limits})
            assert r.status_code == 201, r.text
            made: dict[str, Any] = r.json()
            seen = 0
            # Every worker's mirror has it (a new connection reaches either).
            for _ in range(100):
                async with httpx.AsyncClient(headers=AUTH, timeout=10) as once:
                    if (await once.get(self.gw.url + f"/admin/keys/{made['id']}")
                            ).status_code == 200:
                        seen += 1
                if seen == 8:
                    break
            return made


@contextlib.asynccontextmanager
async def two_workers(cluster: Cluster, tmp: Path, name: str = "gw",
                      **settings: str) -> AsyncIterator[Rig]:
    """A gateway of two workers serving "m" (an external model at the stand-in)."""
    async with stand_in(tmp) as (fake, spec):
        # Two processes starting at once on a shared 2-core machine: slower.
        gw = cluster.gateway(name, ready_within=60, workers="2",
                             provider_key_dir=str(tmp / "keys"), **settings)
        ids = {"0", "1"}
        wait_for(lambda: seen_workers(gw, ids, 8) == ids, 60, "both workers answering")
        async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
            r = await http.put(gw.url + "/admin/models/m", json=spec)
            assert r.status_code == 201, r.text
            r = await http.post(gw.url + "/admin/keys", json={"name": "free"})
            rig = Rig(gw, fake, r.json()["key"])
        deadline = time.monotonic() + 30
        while not all([await rig.chat(rig.free, "warm") == 200 for _ in range(8)]):
            assert time.monotonic() < deadline, "both workers routing m"
            await asyncio.sleep(0.1)
        try:
            yield rig
        finally:
            fake.token_delay = 0.0


async def test_requests_on_new_connections_spread_over_both_workers(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_workers(cluster, tmp_path) as rig:
        assert sorted(worker_pids(rig.gw)) == [0, 1]
        statuses = [await rig.chat(rig.free, f"spread-{i}") for i in range(20)]
        assert statuses == [200] * 20
        per_worker = wait_for(lambda: all(p := [access_workers(rig.gw, f"spread-{i}")
                                                for i in range(20)]) and p,
                              10, "the access lines")  # written by a thread, after the answer
        assert all(len(w) == 1 for w in per_worker), per_worker
        counts = {w: sum(1 for x in per_worker if x == [w]) for w in ("0", "1")}
        assert counts["0"] >= 1 and counts["1"] >= 1, counts
        # Each worker is a gateway of its own in the store, one port between them.
        with rig.gw.admin() as admin:
            ids = sorted(g["id"] for g in admin.get("/admin/gateways").json())
        assert ids == ["gw", "gw-w1"]
        assert f"gateway gw: 2 workers on port {rig.gw.port}" in rig.gw.output()


def scraped(gw: GatewayProc) -> tuple[float, float]:
    """One scrape of /metrics on a new connection (either worker's):
    `llmgw_requests_total` of model m answered 200, and `llmgw_leader`."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(gw.url + "/metrics", timeout=10, verify=gw.verify)
    r.raise_for_status()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    return (got.get(("llmgw_requests_total", (("code", "200"), ("model", "m"))), 0.0),
            got[("llmgw_leader", ())])


async def test_metrics_are_the_gateways_whichever_worker_answers_the_scrape(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A scrape reaches either worker; each says the gateway's figures:
    every worker's requests summed (app/gateway/worker_metrics.py), never
    going back from one scrape to the next, and that the gateway leads.
    Seen to fail: a scrape said the answering worker's own count (14 of
    the 28 requests), and `llmgw_leader` was the first worker's alone."""
    async with two_workers(cluster, tmp_path) as rig:
        statuses = [await rig.chat(rig.free, f"metrics-{i}") for i in range(20)]
        assert statuses == [200] * 20
        wait_for(lambda: all(access_workers(rig.gw, f"metrics-{i}") for i in range(20)), 10,
                 "the access lines")
        served = [access_workers(rig.gw, f"metrics-{i}")[0] for i in range(20)]
        assert {"0", "1"} <= set(served), served  # both counted some
        await asyncio.sleep(2.5)  # a write interval: every worker's file is current
        scrapes = [await asyncio.to_thread(scraped, rig.gw) for _ in range(16)]
        totals = [n for n, _ in scrapes]
        assert len(set(totals)) == 1 and totals[0] >= 20 + 8, totals  # 8 warm-up requests
        assert [leads for _, leads in scrapes] == [1.0] * 16, scrapes
        # More requests: every later scrape says at least as many.
        assert [await rig.chat(rig.free, f"more-{i}") for i in range(6)] == [200] * 6
        later = [(await asyncio.to_thread(scraped, rig.gw))[0] for _ in range(16)]
        assert all(b >= a for a, b in zip([totals[0], *later], later, strict=False)), later
        await asyncio.sleep(2.5)
        assert (await asyncio.to_thread(scraped, rig.gw))[0] == totals[0] + 6


async def test_a_keys_limits_hold_across_two_workers(cluster: Cluster, tmp_path: Path) -> None:
    async with two_workers(cluster, tmp_path, key_usage_interval="0.5") as rig:
        rpm = await rig.key(requests_per_minute=4)
        conc = await rig.key(concurrent_requests=2)
        # Requests per minute, each on a new connection (either worker): the
        # limit, plus at most one on a worker whose claim was still 0.
        got = []
        for i in range(12):
            got.append(await rig.chat(rpm["key"], f"rpm-{i}"))
            await asyncio.sleep(0.2)
        ok = got.count(200)
        assert 4 <= ok <= 4 + 2 - 1 and got.count(429) == 12 - ok, got
        # Usage: both workers' records summed (each worker writes its own).
        async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
            async def usage() -> dict[str, Any]:
                r = await http.get(rig.gw.url + f"/admin/keys/{rpm['id']}/usage")
                out: dict[str, Any] = r.json()
                return out

            deadline = time.monotonic() + 10
            while (await usage())["total"]["requests"] != ok:
                assert time.monotonic() < deadline, await usage()
                await asyncio.sleep(0.2)
        # Concurrency: streams held open, asked for on new connections for
        # 3 s: never more than L + N - 1 = 3 at once at the engine, and the
        # limit reached.
        rig.fake.token_delay = 1.5  # each stream several seconds
        peak = admitted = 0

        async def one(i: int) -> None:
            nonlocal admitted
            start = time.monotonic()
            while time.monotonic() - start < 3.0:
                if await rig.chat(conc["key"], f"conc-{i}", stream=True) == "done":
                    admitted += 1
                    return
                await asyncio.sleep(0.1)

        async def watch() -> None:
            nonlocal peak
            while True:  # the stand-in runs on this loop: its count is exact
                peak = max(peak, rig.fake.stats.running)
                await asyncio.sleep(0.01)

        watching = asyncio.create_task(watch())
        await asyncio.gather(*(one(i) for i in range(6)))
        watching.cancel()
        assert 2 <= peak <= 2 + 2 - 1 and admitted >= 2, (peak, admitted)


async def test_a_killed_worker_loses_only_its_streams_and_is_restarted(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_workers(cluster, tmp_path) as rig:
        before = worker_pids(rig.gw)
        rig.fake.token_delay = 1.0  # streams of several seconds
        streams = [asyncio.create_task(rig.chat(rig.free, f"kill-{i}", stream=True))
                   for i in range(12)]
        await asyncio.sleep(1.0)  # all open
        os.kill(before[1], signal.SIGKILL)
        ends = await asyncio.gather(*streams)
        cut = [i for i, e in enumerate(ends) if e == "cut"]
        done = [i for i, e in enumerate(ends) if e == "done"]
        assert len(cut) + len(done) == 12, ends
        # Every stream that ended well ran on worker 0; every one cut ran on
        # worker 1 (it never wrote its access line), and there were some.
        wait_for(lambda: all(access_workers(rig.gw, f"kill-{i}") for i in done), 10,
                 "the access lines of the streams that ended well")  # written after [DONE]
        assert all(access_workers(rig.gw, f"kill-{i}") == ["0"] for i in done), ends
        assert all(access_workers(rig.gw, f"kill-{i}") == [] for i in cut), ends
        assert cut and done, ends
        out = rig.gw.output()
        assert f"worker 1 (pid {before[1]}) ended by signal SIGKILL; restarting in 0.5 s" in out
        after = wait_for(lambda: (p := worker_pids(rig.gw)).get(1, before[1]) != before[1]
                         and p, 20, "worker 1 restarted")
        assert after[0] == before[0]
        rig.fake.token_delay = 0.0
        # From its start on, every request is answered: a restarted worker
        # listens once its mirror has loaded, until then worker 0 takes all.
        statuses: list[int | str] = []
        deadline = time.monotonic() + 60
        while not any(access_workers(rig.gw, f"again-{i}") == ["1"]
                      for i in range(len(statuses))) or len(statuses) < 20:
            assert time.monotonic() < deadline, "worker 1 never served again"
            statuses.append(await rig.chat(rig.free, f"again-{len(statuses)}"))
        assert set(statuses) == {200}, statuses


async def test_llmgw_stop_ends_every_worker_and_their_streams_complete(
    cluster: Cluster, tmp_path: Path
) -> None:
    async with two_workers(cluster, tmp_path, shutdown_notice_seconds="0.5") as rig:
        pids = worker_pids(rig.gw)
        rig.fake.token_delay = 0.5  # streams of ~3 s
        streams = [asyncio.create_task(rig.chat(rig.free, f"stop-{i}", stream=True))
                   for i in range(8)]
        await asyncio.sleep(0.8)
        stop = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "stop", "--data-dir", str(tmp_path / "gw"),
            "--timeout", "30", cwd=ROOT, env=rig.gw.env)
        ends = await asyncio.gather(*streams)
        assert ends == ["done"] * 8
        assert await asyncio.wait_for(stop.wait(), 40) == 0
        assert rig.gw.wait(5) == -signal.SIGTERM  # killed by its SIGTERM, as without workers
        assert sorted(pids) == [0, 1] and worker_pids(rig.gw) == {}
        assert not (tmp_path / "gw" / "llmgw.pid").exists()
        out = rig.gw.output()
        assert "stopping 2 workers (signal SIGTERM)" in out
        for w in ("0", "1"):
            assert re.search(rf"gateway gw(-w1)? stopped worker={w}", out), w
        # Both served streams up to the end (their access lines).
        assert {w for i in range(8) for w in access_workers(rig.gw, f"stop-{i}")} == {"0", "1"}


async def test_one_leader_among_the_workers_of_two_gateways(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.ttl = 4
    gws = [cluster.gateway(n, ready_within=60, workers="2", etcd_timeout="2")
           for n in ("ga", "gb")]
    everyone = {"ga:0", "ga:1", "gb:0", "gb:1"}

    def views() -> dict[str, dict[str, Any]]:
        """/admin/leader as each of the four workers answers it, by
        "GATEWAY:WORKER"."""
        out: dict[str, dict[str, Any]] = {}
        for gw in gws:
            for _ in range(40):
                with contextlib.suppress(httpx.HTTPError):
                    worker, r = asked(gw, "/admin/leader")
                    out[f"{gw.name}:{worker}"] = r.json()
                if len([g for g in out if g.startswith(gw.name)]) == 2:
                    break
        return out

    def one_leader() -> str | None:
        v = views()
        leaders = {x["leader"] for x in v.values()}
        if set(v) != everyone or len(leaders) != 1 or None in leaders:
            return None
        for at, x in v.items():  # each worker answers for its gateway
            assert x["gateway"] == at.split(":")[0], v
        (leader,) = leaders
        leading = [at for at, x in v.items() if x["is_leader"]]
        if not leading:
            return None
        # Both workers of the leading gateway say so, and none other.
        assert sorted(leading) == [f"{leader}:0", f"{leader}:1"], v
        return str(leader)

    first = wait_for(one_leader, 30, "one leader that all four workers see")
    assert first in ("ga", "gb")  # a first worker: the others never campaign
    # Its worker 0 SIGKILLed: restarted by its supervisor; the lead is taken
    # again, by a first worker, after the lease (TTL 4 s).
    gw = gws[0] if first == "ga" else gws[1]
    os.kill(worker_pids(gw)[0], signal.SIGKILL)
    wait_for(lambda: worker_pids(gw).get(0), 20, "worker 0 restarted")
    second = wait_for(one_leader, 30, "a leader again")
    assert second in ("ga", "gb")


def test_admin_leader_answers_for_the_gateway_whichever_worker_answers(
    cluster: Cluster,
) -> None:
    """/admin/leader under --workers is the gateway's: its id, and whether
    it leads (its first worker campaigns for it), the same from every
    worker (docs/design/workers.md). Seen to fail: worker 1
    answered `gw-w1`, is_leader false, on the leading gateway's port."""
    gw = cluster.gateway("gw", ready_within=60, workers="2")
    wait_for(lambda: gw.leader()["leader"] == "gw", 30, "gw leading")
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for _ in range(24):
        worker, r = asked(gw, "/admin/leader")
        assert r.status_code == 200, r.text
        by_worker.setdefault(worker, []).append(r.json())
    assert set(by_worker) == {"0", "1"}, by_worker  # both asked (24 connections)
    for worker, answers in by_worker.items():
        assert answers == [{"gateway": "gw", "leader": "gw", "is_leader": True}] * len(
            answers), (worker, answers)


def test_the_default_is_the_cores_with_etcd_and_one_on_the_embedded_store(
    tmp_path: Path
) -> None:
    from app.gateway import workers
    from app.gateway.settings import Settings

    etcd = {"etcd_endpoints": "127.0.0.1:2379", "secret": "s" * 32, "admin_token": "a" * 32}
    assert workers.count(Settings(**etcd)) == len(os.sched_getaffinity(0))  # type: ignore[arg-type]
    assert workers.count(Settings(**etcd, workers=3)) == 3  # type: ignore[arg-type]
    assert workers.count(Settings(data_dir=tmp_path)) == 1
    assert workers.count(Settings(**etcd, local_agent=True)) == 1  # type: ignore[arg-type]
    assert workers.count(Settings(data_dir=tmp_path, workers=1)) == 1
    with pytest.raises(workers.Refused, match="LLMGW_WORKERS=2 needs etcd"):
        workers.count(Settings(data_dir=tmp_path, workers=2))
    with pytest.raises(workers.Refused, match="LLMGW_LOCAL_AGENT=true"):
        workers.count(Settings(**etcd, workers=2, local_agent=True))  # type: ignore[arg-type]


def test_workers_on_the_embedded_store_are_refused_before_anything_starts(
    tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env |= {"LLMGW_DATA_DIR": str(tmp_path), "LLMGW_PORT": str(free_port())}
    run = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--workers", "2"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "llmgw serve: LLMGW_WORKERS=2 needs etcd (LLMGW_ETCD_ENDPOINTS)" in run.stderr
    assert not (tmp_path / "llmgw.pid").exists() and not (tmp_path / "state.db").exists()


def test_both_workers_serve_tls_from_the_same_files(cluster: Cluster, tmp_path: Path) -> None:
    from tests.test_tls import issue

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    cert, key = issue(ca, tmp_path, "gw")
    gw = cluster.gateway("gw", ca=str(tmp_path / "ca.pem"), ready_within=60, workers="2",
                         tls_cert_file=str(cert), tls_key_file=str(key))
    assert gw.url.startswith("https://")
    ids = {"0", "1"}
    wait_for(lambda: seen_workers(gw, ids, 8) == ids, 60, "both workers answering https")
    for _ in range(8):  # nothing in clear on the port, whichever worker answers
        with pytest.raises(httpx.HTTPError):
            httpx.get(gw.url.replace("https://", "http://") + "/healthz", timeout=5)
