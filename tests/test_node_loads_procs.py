"""Engine loads gathered once per node, across real processes: two agents
with the vLLM stand-in, three gateways (docs/design/routing.md, "Choosing a replica").
The gatherer and the gateways' poller are tested in-process in
tests/test_node_loads.py."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.support.procs import Cluster, GatewayProc, put_model, replicas, wait_for


def scrapes(engine_url: str) -> float:
    """The /metrics requests the engine has served, this one included."""
    text = httpx.get(engine_url + "/metrics", timeout=5).text
    line = next(x for x in text.splitlines()
                if x.startswith("fake_vllm_metrics_requests_total "))
    return float(line.split()[1])


def engine_figures(gw: GatewayProc) -> dict[str, Any]:
    with gw.admin() as admin:
        rows = admin.get("/admin/routes", params={"model": "m"}).json()["endpoints"]
    return {r["replica"]: r["engine"] for r in rows}


def test_engines_are_scraped_once_a_second_whatever_the_gateways(cluster: Cluster) -> None:
    gws = [cluster.gateway(f"gw-{n}") for n in "abc"]
    # A steady load of its own on each node's engine: what every gateway must show.
    cluster.agent("node-1", gws, "--gpus", "1", env_extra={"FAKE_VLLM_BASE_LOAD": "2,1"})
    cluster.agent("node-2", gws, "--gpus", "1", env_extra={"FAKE_VLLM_BASE_LOAD": "5,0"})
    put_model(gws[0], "m", {"model": "acme/m", "gpus": 1, "replicas": {"min": 2, "max": 2}})
    ready = wait_for(lambda: (lambda rs: rs if len(rs) == 2 else None)(
        [r for r in replicas(gws[0]) if r["phase"] == "ready"]), 40, "two ready replicas")
    want = {r["id"]: {"running": 2.0, "waiting": 1.0, "kv_cache": 0.0} if r["node"] == "node-1"
            else {"running": 5.0, "waiting": 0.0, "kv_cache": 0.0} for r in ready}
    assert {r["node"] for r in ready} == {"node-1", "node-2"}

    # Every gateway decides on the same figures: the engines' own.
    for gw in gws:
        wait_for(lambda gw=gw: engine_figures(gw) == want, 20,  # type: ignore[misc]
                 f"{gw.name} showing both engines' figures")

    # About once a second per engine in all: the agent's reads, not one per gateway.
    urls = [r["url"] for r in ready]
    before = {u: scrapes(u) for u in urls}
    start = time.monotonic()
    time.sleep(8)
    after = {u: scrapes(u) for u in urls}
    took = time.monotonic() - start
    rates = {u: (after[u] - before[u] - 1) / took for u in urls}  # less our own read
    print(f"scrapes per engine per second with 3 gateways: {rates}")
    assert all(0.5 <= r <= 1.5 for r in rates.values()), rates
    for gw in gws:
        assert engine_figures(gw) == want, gw.name


def test_a_gateways_workers_split_the_poll_and_each_routes_by_every_engine(
    cluster: Cluster,
) -> None:
    """`llmgw serve --workers 2`: each node is asked by one worker, whose
    figures reach the other through the data dir (app/gateway/worker_loads.py),
    so whichever worker a connection reaches shows every engine's figures."""
    import json
    import zlib

    gw = cluster.gateway("gw", ready_within=60, workers="2")
    cluster.agent("node-1", [gw], "--gpus", "1", env_extra={"FAKE_VLLM_BASE_LOAD": "2,1"})
    cluster.agent("node-2", [gw], "--gpus", "1", env_extra={"FAKE_VLLM_BASE_LOAD": "5,0"})
    put_model(gw, "m", {"model": "acme/m", "gpus": 1, "replicas": {"min": 2, "max": 2}})
    ready = wait_for(lambda: (lambda rs: rs if len(rs) == 2 else None)(
        [r for r in replicas(gw) if r["phase"] == "ready"]), 60, "two ready replicas")
    want = {r["id"]: {"running": 2.0, "waiting": 1.0, "kv_cache": 0.0} if r["node"] == "node-1"
            else {"running": 5.0, "waiting": 0.0, "kv_cache": 0.0} for r in ready}
    # Each admin() is a new connection: the kernel hands it to either worker.
    wait_for(lambda: all(engine_figures(gw) == want for _ in range(8)), 30,
             "both workers showing both engines' figures")
    # Each replica's figures were asked by the worker its node hashes to.
    folder = cluster.tmp / "gw" / "worker-loads"
    files = {i: set(json.loads((folder / f"{i}.json").read_text())["loads"]) for i in (0, 1)}
    assert files == {i: {r["id"] for r in ready
                         if zlib.crc32(r["node"].encode()) % 2 == i} for i in (0, 1)}, files
