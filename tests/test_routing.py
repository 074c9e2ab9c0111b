"""The request path under failure: retries before the first byte, and the
in-flight count released when a client walks away mid-stream."""

from __future__ import annotations

import signal

import httpx
import openai

from tests.support.procs import (
    Cluster,
    kill_engine,
    make_key,
    put_model,
    replicas,
    routes,
    wait_for,
)


def test_dead_replica_is_skipped_before_the_first_byte(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a")
    agent = cluster.agent("node-1", [gw], "--gpus", "2")
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1, "replicas": {"min": 2, "max": 2}})

    def two_ready() -> list[dict[str, object]] | None:
        ready = [r for r in replicas(gw) if r["phase"] == "ready"]
        return ready if len(ready) == 2 else None

    dead, live = wait_for(two_ready, 30, "two ready replicas")
    wait_for(lambda: routes(gw, key, "m"), 5, "routing")

    # Kill one engine behind the agent's back, the agent paused so that it
    # cannot report it: the router still lists the dead replica throughout.
    agent.signal(signal.SIGSTOP)
    try:
        kill_engine(str(dead["url"]))
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for i in range(6):
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": f"still here {i}"}])
            assert raw.headers["x-llmgw-replica"] == live["id"]
            assert f"still here {i}" in (raw.parse().choices[0].message.content or "")
        assert [r["id"] for r in replicas(gw) if r["phase"] == "ready"] == [dead["id"], live["id"]]
    finally:
        agent.signal(signal.SIGCONT)
    # Least in-flight with round-robin ties sends idle requests to both replicas
    # in turn: the dead one was chosen first, and the request retried.
    assert gw.output().count(f"replica {dead['id']} failed (") >= 1
    # The agent notices and reports the replica failed, so it leaves the router.
    wait_for(lambda: any(r["phase"] == "failed" for r in replicas(gw)), 15, "failure seen")


def test_client_leaving_mid_stream_releases_its_slot(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "1",
                  env_extra={"FAKE_VLLM_TOKEN_DELAY": "0.3"})
    key = make_key(gw)
    put_model(gw, "slow", {"model": "acme/slow", "gpus": 1})
    wait_for(lambda: routes(gw, key, "slow"), 30, "routing")

    body = {"model": "slow", "stream": True, "max_tokens": 50,
            "messages": [{"role": "user", "content": " ".join(["word"] * 40)}]}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # kept: a dropped iterator closes the stream
        first = next(chunks)
        assert first.startswith(b"data: ")
        assert [x["inflight"] for x in replicas(gw)] == [1]
    # The client closed the connection long before the engine was done.
    wait_for(lambda: [x["inflight"] for x in replicas(gw)] == [0], 5, "the slot released")
