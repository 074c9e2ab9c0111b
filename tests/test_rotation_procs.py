"""Rotating LLMGW_SECRET on a running fleet, across real processes, as the
operator's procedure says (docs/design/security-operations.md, "Rotating the shared secret"):
two gateways restarted one at a time with the new secret and
the previous one, the leader replacing every replica new-before-old, the
agent given its new token, the previous secret unset. A client asking all
along gets no error, and at the end every replica is new and its engine
answers the new key only."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from app.control.keys import engine_key, secret_id
from app.wire.tokens import node_token
from tests.support.procs import (
    SECRET,
    Cluster,
    GatewayProc,
    Proc,
    make_key,
    put_model,
    replicas,
    restart_gateway,
    routes,
    wait_for,
)

NEW = "rotated-secret-0123456789abcdef"


def restart_agent(cluster: Cluster, agent: Proc, token: str) -> Proc:
    agent.signal(signal.SIGTERM)  # its engines run on, for the next run to adopt
    agent.wait(30)
    new = dataclasses.replace(agent, env=agent.env | {"LLMGW_AGENT_TOKEN": token}, popen=None)
    new.start()
    cluster.procs.append(new)
    return new


def test_rotating_the_secret_fails_no_request_and_replaces_every_replica(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_VLLM_STARTUP_DELAY", "1")
    gws = [cluster.gateway(n, usage_interval="0.5") for n in ("gw-a", "gw-b")]
    agent = cluster.agent("node-1", gws, "--gpus", "4")
    wait_for(lambda: gws[0].admin().get("/admin/nodes").json(), 15, "node-1 registered")
    key = make_key(gws[0])
    put_model(gws[0], "chat", {"model": "acme/chat", "gpus": 1,
                               "replicas": {"min": 2, "max": 2}})
    wait_for(lambda: [r["phase"] for r in replicas(gws[0])] == ["ready"] * 2, 60,
             "two ready replicas")
    before = {r["id"] for r in replicas(gws[0])}
    assert {r["secret"] for r in replicas(gws[0])} == {secret_id(SECRET)}
    for gw in gws:
        wait_for(lambda g=gw: routes(g, key, "chat"), 10, f"{gw.name} routing")

    # A client asking all along, through one gateway while the other restarts.
    target, lock = [gws[0]], threading.Lock()
    answered, failures = [0], list[str]()
    done = threading.Event()

    def ask() -> None:
        clients: dict[str, openai.OpenAI] = {}
        while not done.is_set():
            with lock:  # never a request on its way to a gateway being stopped
                url = target[0].url
                client = clients.setdefault(url, openai.OpenAI(
                    base_url=url + "/v1", api_key=key, max_retries=0))
                try:
                    client.chat.completions.create(
                        model="chat", messages=[{"role": "user", "content": "hi"}])
                    answered[0] += 1
                except openai.OpenAIError as exc:
                    failures.append(f"{time.strftime('%X')} via {url}: {exc!r}")
            time.sleep(0.01)

    def use(gw: GatewayProc) -> None:
        with lock:
            target[0] = gw

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        # 1. Every gateway gets the new secret, the old one as the previous.
        gws[1] = restart_gateway(cluster, gws[1], key, LLMGW_SECRET=NEW,
                                 LLMGW_PREVIOUS_SECRET=SECRET)
        use(gws[1])
        gws[0] = restart_gateway(cluster, gws[0], key, LLMGW_SECRET=NEW,
                                 LLMGW_PREVIOUS_SECRET=SECRET)

        # 2. The leader replaces every replica, new before old.
        def rotated() -> list[dict[str, Any]] | None:
            reps = replicas(gws[0])
            ok = len(reps) == 2 and all(
                r["secret"] == secret_id(NEW) and r["phase"] == "ready" for r in reps)
            return reps if ok else None

        after = wait_for(rotated, 90, "every replica replaced under the new secret")
        assert not before & {r["id"] for r in after}
        for r in after:
            models = httpx.get(r["url"] + "/v1/models", timeout=5, headers={
                "Authorization": f"Bearer {engine_key(NEW, r['id'])}"})
            assert models.status_code == 200, models.text
            old = httpx.get(r["url"] + "/v1/models", timeout=5, headers={
                "Authorization": f"Bearer {engine_key(SECRET, r['id'])}"})
            assert old.status_code == 401

        # 3. The agent gets its new token; then the previous secret goes.
        agent = restart_agent(cluster, agent, node_token(NEW, "node-1"))
        # The two new engines are adopted, whatever else the log holds: an
        # old engine whose stop the agent had not reached before its SIGTERM
        # is adopted too, then stopped ("stopped adopted engine for ...").
        wait_for(lambda: all(f"adopted engine of {r['id']} (" in agent.output()
                             for r in after), 20, "the two new engines adopted")
        use(gws[0])
        gws[1] = restart_gateway(cluster, gws[1], key, LLMGW_PREVIOUS_SECRET=None)
        use(gws[1])
        gws[0] = restart_gateway(cluster, gws[0], key, LLMGW_PREVIOUS_SECRET=None)
        use(gws[0])
        time.sleep(3)  # heartbeats and polls of the new token, requests on both
        assert [r["phase"] for r in replicas(gws[0])] == ["ready"] * 2
        assert {r["id"] for r in replicas(gws[0])} == {r["id"] for r in after}
    finally:
        done.set()
        asker.join(30)
    assert failures == [], failures[:5]
    assert answered[0] > 50
    # The window is closed: a token of the old secret opens nothing now.
    refused = httpx.get(gws[0].url + "/agent/v1/nodes/node-1/assignments", timeout=5,
                        headers={"Authorization": f"Bearer {node_token(SECRET, 'node-1')}"})
    assert refused.status_code == 401
