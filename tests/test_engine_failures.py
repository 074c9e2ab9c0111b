"""An engine that keeps dying (a build for another CPU dies with SIGILL on its
first real request) is not reported ready again and again: its replica ends
`failed`, and the admin API and the router's 503 say why."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from app.control.keys import engine_key
from tests.support.procs import SECRET, Cluster, make_key, put_model, replicas, wait_for


def test_an_engine_dying_by_a_signal_ends_failed_and_every_answer_says_why(
    cluster: Cluster,
) -> None:
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "1",
                  env_extra={"FAKE_VLLM_DIE_ON_CHAT": "SIGILL"})
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10)

    def model_status() -> dict[str, Any]:
        with gw.admin() as admin:
            return dict(admin.get("/admin/models/m").json()["status"])

    ready_seen = 0
    last_ready: str | None = None

    def given_up() -> bool:
        """Sends a chat whenever the replica is ready (each one kills it),
        until the agent leaves it failed."""
        nonlocal ready_seen, last_ready
        reps = replicas(gw)
        if not reps:
            return False  # not placed yet
        (rep,) = reps
        if rep["phase"] == "ready" and rep["url"] != last_ready:
            ready_seen += 1
            last_ready = rep["url"]  # each restart is a new process on a new port
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
            assert err.value.status_code in (502, 503)
        return rep["phase"] == "failed" and "not restarted" in rep["detail"]

    wait_for(given_up, 90, "the replica left failed", interval=0.2)
    # It was restarted after the first deaths, and then no more.
    assert ready_seen == 3
    (rep,) = replicas(gw)
    assert "killed by SIGILL" in rep["detail"] and "3 deaths" in rep["detail"]
    assert "FAKE_VLLM_DIE_ON_CHAT=SIGILL" in rep["detail"]  # the engine's last log lines
    assert engine_key(SECRET, rep["id"]) not in rep["detail"]

    status = model_status()
    assert status["ready"] == 0
    assert [f["id"] for f in status["failed"]] == [rep["id"]]
    assert "killed by SIGILL" in status["failed"][0]["detail"]

    r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "no_ready_replica"
    assert f"replica {rep['id']} is failed" in err["message"]
    assert "killed by SIGILL" in err["message"]
    assert engine_key(SECRET, rep["id"]) not in r.text
