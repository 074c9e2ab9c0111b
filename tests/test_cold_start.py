"""Scale from zero: a request for a model whose replica is on its way is
held until it can be routed, not refused (docs/design/routing.md).
In-process against the proxy, then through real processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import openai
import pytest

from app.router.timeouts import Timeouts
from tests.support.procs import Cluster, make_key, put_model, replicas, wait_for
from tests.support.proxy_rig import MESSAGES, AsgiCall, Rig, started


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    timeouts = Timeouts(connect=2, first_byte=10, idle=10, request=10, cooldown=5,
                        cold_start=2, cold_start_held=2)
    async with started(Rig(timeouts)) as r:
        yield r


async def test_a_held_request_is_answered_once_a_replica_is_routable(rig: Rig) -> None:
    up = await rig.upstream("r1")
    rig.table.set_holdable({"small"})
    call = asyncio.create_task(rig.chat("small"))
    await asyncio.sleep(0.2)
    assert not call.done() and rig.table.held() == {"small": 1}
    rig.route("small", ("r1", up.url))  # the replica became ready
    resp = await asyncio.wait_for(call, 5)
    assert resp.status_code == 200 and resp.headers["x-llmgw-replica"] == "r1"
    assert rig.table.held() == {}
    # Not on its way (say its replica failed): 503 at once, with the reason.
    rig.table.set_endpoints({})
    rig.table.set_holdable(set())
    rig.table.set_unavailable({"small": "replica r1 is failed on n1: killed by SIGILL"})
    resp = await asyncio.wait_for(rig.chat("small"), 1)
    assert resp.status_code == 503 and "killed by SIGILL" in resp.json()["error"]["message"]


async def test_held_requests_are_capped_and_time_out_with_retry_after(rig: Rig) -> None:
    rig.table.set_holdable({"small"})
    rig.table.set_unavailable({"small": "replica r1 is starting on n1"})
    first = [asyncio.create_task(rig.chat("small")) for _ in range(2)]
    await asyncio.sleep(0.2)
    over = await rig.chat("small")  # the cap is 2 held per model
    assert over.status_code == 503 and over.headers["retry-after"]
    assert over.json()["error"]["code"] == "model_starting"
    timed_out = await asyncio.wait_for(asyncio.gather(*first), 5)
    for r in timed_out:
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "became ready within 2 s: replica r1 is starting" in r.json()["error"]["message"]
    assert rig.table.held() == {}


async def test_a_held_stream_keeps_alive_then_streams(rig: Rig) -> None:
    up = await rig.upstream("r1", mode="endless")
    rig.table.set_holdable({"small"})
    call = AsgiCall(rig.proxy, {"model": "small", "messages": MESSAGES, "stream": True})
    start = await call.next()
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert dict(start["headers"])[b"x-llmgw-held"] == b"cold-start"
    comment = await call.next()
    assert comment["body"].startswith(b": waiting for a replica of small")
    rig.route("small", ("r1", up.url))
    data = await call.next()
    assert data["body"].startswith(b"data: ")  # the engine's events follow, no second start
    call.leave.set()
    await asyncio.wait_for(call.task, 5)


async def test_a_held_stream_that_times_out_ends_with_an_error_event(rig: Rig) -> None:
    rig.table.set_holdable({"small"})
    call = AsgiCall(rig.proxy, {"model": "small", "messages": MESSAGES, "stream": True})
    assert (await call.next())["status"] == 200
    body = b""
    while True:
        msg = await asyncio.wait_for(call.sent.get(), 5)
        body += msg.get("body", b"")
        if not msg.get("more_body", False):
            break
    last = body.strip().split(b"\n\n")[-1]
    assert last.startswith(b"data: ") and b"[DONE]" not in body
    assert json.loads(last[6:])["error"]["code"] == "no_ready_replica"


def test_a_min_zero_model_starts_on_demand_and_holds_the_request(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a", usage_interval="0.2")
    cluster.agent("node-1", [gw], "--gpus", "1",
                  env_extra={"FAKE_VLLM_STARTUP_DELAY": "1.5"})
    key = make_key(gw)
    put_model(gw, "lazy", {"model": "acme/lazy", "gpus": 1,
                           "replicas": {"min": 0, "max": 1}, "idle_timeout": 600})
    wait_for(lambda: gw.admin().get("/admin/nodes").json(), 15, "node-1 registered")
    assert replicas(gw) == []  # never used: nothing runs
    with gw.admin() as admin:
        assert admin.get("/admin/models/lazy").json()["status"]["wanted"] == 0
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    # Held while the leader places a replica and its engine loads, then answered.
    chat = client.chat.completions.create(
        model="lazy", messages=[{"role": "user", "content": "wake up"}])
    assert "wake up" in (chat.choices[0].message.content or "")
    (rep,) = replicas(gw)
    assert rep["phase"] == "ready"
    with gw.admin() as admin:  # used now: the model wants its one replica
        assert admin.get("/admin/models/lazy").json()["status"]["wanted"] == 1
    stream = client.chat.completions.create(
        model="lazy", messages=[{"role": "user", "content": "again"}], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "again" in text
