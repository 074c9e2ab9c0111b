"""A fleet on a 3-member etcd: the etcd leader dies, llmgw does not notice
beyond a pause, and its leader keeps its lease (TTL 10 rides it out)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.etcd_server import EtcdCluster
from tests.support.etcd import etcd_binary
from tests.support.procs import Cluster, make_key, put_model, replicas, routes, wait_for


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(etcd_binary(), tmp_path / "etcd")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_fleet_rides_out_the_loss_of_the_etcd_leader(etcd3: EtcdCluster, tmp_path: Path) -> None:
    fleet = Cluster(tmp_path, etcd3.endpoints, "/llmgw/")
    try:
        a, b = fleet.gateway("gw-a"), fleet.gateway("gw-b")
        fleet.agent("node-1", [a, b], "--gpus", "2")
        key = make_key(a)
        put_model(a, "m", {"model": "acme/m", "gpus": 1})
        wait_for(lambda: routes(b, key, "m"), 30, "routing on gw-b")
        leader = wait_for(lambda: a.leader()["leader"], 10, "a gateway leader")

        etcd3.leader().kill()
        killed = time.monotonic()
        client = openai.OpenAI(base_url=b.url + "/v1", api_key=key, max_retries=0)
        for i in range(3):  # the request path never waits on etcd
            chat = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"etcd failover {i}"}])
            assert f"etcd failover {i}" in (chat.choices[0].message.content or "")

        # Writes resume once etcd has a new leader; the placement follows.
        wait_for(lambda: b.admin().put("/admin/models/n", json={
            "model": "acme/n", "gpus": 1}).status_code == 201, 20, "a write accepted")
        print(f"writes accepted again {time.monotonic() - killed:.1f} s after the etcd leader died")
        wait_for(lambda: routes(a, key, "n"), 30, "the new model routed")
        assert {r["model"] for r in replicas(a) if r["phase"] == "ready"} == {"m", "n"}
        # The same gateway still leads: its lease outlived etcd's election.
        assert a.leader()["leader"] == leader and b.leader()["leader"] == leader
    finally:
        fleet.close()
