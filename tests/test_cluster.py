"""Three gateways on one etcd: election, failover, catalog propagation."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

from tests.support.procs import Cluster, GatewayProc, make_key, wait_for

TTL = 4


def agreed_leader(gws: list[GatewayProc]) -> str | None:
    views = [g.leader() for g in gws]
    named = {v["leader"] for v in views}
    claiming = [v["gateway"] for v in views if v["is_leader"]]
    if len(named) == 1 and len(claiming) == 1 and claiming[0] in named:
        return claiming[0]
    return None


@pytest.fixture
def three(cluster: Cluster) -> list[GatewayProc]:
    cluster.ttl = TTL
    # A lease of 4 s needs etcd calls that give up within 2 s (app/gateway/settings/__init__.py).
    return [cluster.gateway(n, etcd_timeout="2") for n in ("gw-a", "gw-b", "gw-c")]


def test_exactly_one_leader_and_sigkill_failover(three: list[GatewayProc]) -> None:
    leader = wait_for(lambda: agreed_leader(three), 10, "one agreed leader")
    assert sum(g.leader()["is_leader"] for g in three) == 1
    old = next(g for g in three if g.gateway_id == leader)
    rest = [g for g in three if g is not old]

    killed = time.monotonic()
    old.signal(signal.SIGKILL)
    new = wait_for(lambda: agreed_leader(rest), TTL + 2, "a new leader after SIGKILL")
    took = time.monotonic() - killed
    print(f"SIGKILL failover: {took:.2f} s (TTL {TTL} s)")
    assert new != leader
    assert took <= TTL + 2


def test_sigterm_hands_over_within_2s(three: list[GatewayProc]) -> None:
    leader = wait_for(lambda: agreed_leader(three), 10, "one agreed leader")
    old = next(g for g in three if g.gateway_id == leader)
    rest = [g for g in three if g is not old]

    stopped = time.monotonic()
    old.signal(signal.SIGTERM)
    new = wait_for(lambda: agreed_leader(rest), 2.0, "a new leader after SIGTERM")
    took = time.monotonic() - stopped
    print(f"SIGTERM handover: {took:.2f} s")
    assert new != leader
    # uvicorn re-raises the signal once its graceful shutdown is done.
    assert old.wait(10) in (0, -signal.SIGTERM), old.output()[-2000:]
    assert f"gateway {old.gateway_id} stopped" in old.output()


def test_model_put_on_a_reaches_b_and_c_within_1s(three: list[GatewayProc]) -> None:
    a, b, c = three
    client_key = make_key(a)
    spec = {"model": "org/weights-1", "aliases": ["fast"], "engine": "vllm", "gpus": 1}
    with a.admin() as admin:
        r = admin.put("/admin/models/propagated", json=spec)
        assert r.status_code == 201, r.text
    put_at = time.monotonic()

    def listed(g: GatewayProc) -> bool:
        r = httpx.get(g.url + "/v1/models", headers={"Authorization": f"Bearer {client_key}"})
        return "propagated" in {m["id"] for m in r.json()["data"]}

    wait_for(lambda: listed(b) and listed(c), 1.0, "the model on gateways B and C")
    print(f"catalog propagation: {time.monotonic() - put_at:.3f} s")
    client = openai.OpenAI(base_url=c.url + "/v1", api_key=client_key, max_retries=0)
    assert client.models.retrieve("fast").root == "propagated"  # type: ignore[attr-defined]
