"""With etcd unreachable, routing goes on from the mirror; writes answer 503
and lose nothing; when etcd returns, everything resumes (DESIGN invariant 2).
A gateway says it lost etcd once in its log, when it happens, and on /readyz
for as long as it lasts.

Every test here runs its own etcd (`own_etcd`) or none: stopping the
session's shared one would break the tests sharing it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import httpx
import openai
import pytest

from app.store.base import LeaseExpired, StoreError, StoreUnavailable
from app.store.etcd.errors import translated
from app.store.health import HealthTracker
from tests.support.etcd import EtcdServer, free_port, unready_gateway
from tests.support.procs import (
    ADMIN,
    Cluster,
    GatewayProc,
    make_key,
    put_model,
    routes,
    wait_for,
    wait_ready,
)

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
UNREACHABLE_LINE = "is unreachable:"  # app/store/health.py, once per outage
BACK_LINE = "is reachable again"


def readyz(gw: GatewayProc) -> httpx.Response:
    return httpx.get(gw.url + "/readyz", timeout=5)


def test_routing_survives_etcd_down_and_writes_refuse_cleanly(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    cluster = Cluster(tmp_path, own_etcd.endpoint, "/llmgw/")
    try:
        gw = cluster.gateway("gw-a", etcd_timeout="1")
        cluster.agent("node-1", [gw], "--gpus", "1")
        key = make_key(gw)
        put_model(gw, "m", {"model": "acme/m", "aliases": ["alias-m"], "gpus": 1})
        wait_ready(gw)
        wait_for(lambda: routes(gw, key, "alias-m"), 5, "routing")
        assert readyz(gw).json()["store"] == "ok"

        own_etcd.stop()
        stopped = time.time()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for _ in range(3):
            chat = client.chat.completions.create(
                model="alias-m", messages=[{"role": "user", "content": "etcd is down"}])
            assert "etcd is down" in (chat.choices[0].message.content or "")
        assert [m.id for m in client.models.list()] == ["m", "alias-m"]

        for _ in range(3):  # each a failed call to etcd: still one log line
            r = httpx.put(gw.url + "/admin/models/other", json={"model": "x"},
                          headers=ADMIN_HEADERS, timeout=30)
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/problem+json")
            assert "not saved" in r.json()["detail"]
        # Reads still answer from the mirror.
        r = httpx.get(gw.url + "/admin/models", headers=ADMIN_HEADERS, timeout=10)
        assert r.status_code == 200 and [m["name"] for m in r.json()] == ["m"]
        # Loaded: still ready (routing goes on), but the store is reported lost.
        r = readyz(gw)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "ready", body
        assert body["store"].startswith("unreachable: etcd "), body
        assert stopped - 5 < body["since"] <= time.time(), body
        assert gw.logged(UNREACHABLE_LINE).count(UNREACHABLE_LINE) == 1, gw.output()

        own_etcd.start()
        wait_for(lambda: httpx.put(gw.url + "/admin/models/other", json={"model": "x"},
                                   headers=ADMIN_HEADERS, timeout=10).status_code == 201,
                 20, "writes accepted again")
        wait_for(lambda: gw.leader()["is_leader"], 20, "leadership regained")
        assert routes(gw, key, "m")
        body = readyz(gw).json()
        assert body["store"] == "ok" and "since" not in body, body
        log = gw.logged(BACK_LINE)
        assert log.count(UNREACHABLE_LINE) == 1 and log.count(BACK_LINE) == 1, log
        assert "Traceback" not in log
    finally:
        cluster.close()


@pytest.mark.parametrize("endpoint, reason", [
    pytest.param(f"127.0.0.1:{free_port()}", "UNAVAILABLE", id="nothing-listens"),
    # .invalid never resolves (RFC 6761).
    pytest.param("etcd.invalid:2379", "cannot resolve etcd.invalid:2379",
                 id="name-does-not-resolve"),
])
def test_a_gateway_cut_off_from_etcd_says_so_once_and_answers_writes_503(
    endpoint: str, reason: str, tmp_path: Path
) -> None:
    cluster = Cluster(tmp_path, endpoint, "/llmgw/")
    try:
        gw = unready_gateway(cluster, "gw-a", etcd_timeout="1")
        wait_for(lambda: httpx.get(gw.url + "/healthz", timeout=1).status_code == 200, 20,
                 "the gateway up")
        writes = [("PUT", "/admin/models/m", {"model": "acme/m"}),
                  ("POST", "/admin/keys", {"name": "k"})]
        for method, path, body in writes * 2:  # each a failed call: still one log line
            r = httpx.request(method, gw.url + path, json=body, headers=ADMIN_HEADERS,
                              timeout=30)
            assert r.status_code == 503, r.text
            assert r.headers["content-type"].startswith("application/problem+json")

        r = wait_for(lambda: (lambda r: r if "store" in r.json() else None)(readyz(gw)),
                     10, "/readyz naming the store")
        body = r.json()
        assert r.status_code == 503 and body["status"] == "loading", body
        assert body["store"].startswith("unreachable: ") and reason in body["store"], body
        assert time.time() - 60 < body["since"] <= time.time(), body
        log = gw.logged(UNREACHABLE_LINE)
        (line,) = [ln for ln in log.splitlines() if UNREACHABLE_LINE in ln]
        assert f"etcd at {endpoint} {UNREACHABLE_LINE}" in line and reason in line, line
        assert "Traceback" not in log
    finally:
        cluster.close()


# -- in-process: the mapping and the log, without processes ---------------------------


def rpc_error(code: Any, details: str = "") -> Any:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("code", [
    grpc.StatusCode.UNKNOWN,  # what gRPC says of a target it cannot use
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # etcd out of space
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
])
def test_every_failure_to_be_served_is_store_unavailable(code: Any) -> None:
    with pytest.raises(StoreUnavailable, match=f"etcd put: {code.name}"), translated("put"):
        raise rpc_error(code, "boom")


def test_etcd_answers_about_the_request_stay_typed() -> None:
    with pytest.raises(LeaseExpired), translated("keepalive"):
        raise rpc_error(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
    with pytest.raises(StoreError) as raised, translated("put"):
        raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large")
    assert not isinstance(raised.value, StoreUnavailable)


def test_health_logs_each_change_once(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    health = HealthTracker("etcd at etcd1:2379", clock=lambda: now[0])
    assert health.current().state == "unknown"
    caplog.set_level(logging.INFO, logger="app.store.health")
    health.succeeded()
    for i in range(5):
        now[0] += 1
        health.failed(f"etcd put: UNAVAILABLE try {i}")
    lost = health.current()
    assert (lost.state, lost.since, lost.reason) == (
        "unreachable", 1001.0, "etcd put: UNAVAILABLE try 4")
    now[0] += 10
    health.succeeded()
    health.succeeded()
    assert health.current().state == "reachable" and health.current().since is None
    assert [r.getMessage() for r in caplog.records] == [
        "etcd at etcd1:2379 is unreachable: etcd put: UNAVAILABLE try 0; "
        "writes answer 503 until it is back",
        "etcd at etcd1:2379 is reachable again after 14.0 s unreachable",
    ]


def test_a_gateway_whose_state_is_not_loaded_answers_a_client_503_not_401(
    tmp_path: Path
) -> None:
    """Found by tests/test_chaos.py: a gateway restarted under a client
    listens before its mirror has loaded, and told a valid key "Incorrect
    API key provided." (401: a client that believes it drops the key)."""
    cluster = Cluster(tmp_path, f"127.0.0.1:{free_port()}", "/llmgw/")
    try:
        gw = unready_gateway(cluster, "gw-a", etcd_timeout="1")
        wait_for(lambda: httpx.get(gw.url + "/healthz", timeout=1).status_code == 200, 20,
                 "the gateway up")
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                       headers={"Authorization": "Bearer sk-any-key-at-all"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "gateway_loading", r.text
        assert "not loaded" in r.json()["error"]["message"] and r.headers["retry-after"]
        r = httpx.get(gw.url + "/v1/models", timeout=10,
                      headers={"Authorization": "Bearer sk-any-key-at-all"})
        assert r.status_code == 503, r.text
    finally:
        cluster.close()
