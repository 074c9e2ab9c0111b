"""An engine that keeps dying (a build for another CPU dies with SIGILL on its
first real request) is not reported ready again and again: its replica ends
`failed`, and the admin API and the router's 503 say why."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.control.keys import engine_key
from tests.support.procs import (
    SECRET,
    Cluster,
    engine_pids,
    make_key,
    put_model,
    replicas,
    routes,
    wait_for,
)


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

    wait_for(lambda: given_up() and ready_seen >= 6, 120, "two replicas left failed",
             interval=0.2)
    # Each replica was restarted after its first deaths, then given up on; the
    # leader placed the first one again at once (on the only node there is),
    # and the second waits out its retry backoff (30 s): failed meanwhile.
    assert ready_seen == 6
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


def test_a_replica_that_keeps_dying_on_one_node_is_placed_on_another(
    cluster: Cluster,
) -> None:
    gw = cluster.gateway("gw-a")
    # node-1 has more free GPUs, so the replica goes there first; its engines die.
    cluster.agent("node-1", [gw], "--gpus", "2", env_extra={"FAKE_VLLM_DIE_ON_CHAT": "SIGILL"})
    cluster.agent("node-2", [gw], "--gpus", "1")
    wait_for(lambda: len(gw.admin().get("/admin/nodes").json()) == 2, 15, "both nodes")
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1})
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10)
    tried: set[str] = set()

    def served_elsewhere() -> bool:
        for rep in replicas(gw):
            if rep["phase"] != "ready" or rep["url"] in tried:
                continue
            if rep["node"] == "node-2":
                return True
            tried.add(rep["url"])  # each restart is a new port
            with pytest.raises(openai.APIStatusError):
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
        return False

    wait_for(served_elsewhere, 90, "the replica placed on node-2", interval=0.2)
    chat = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "still there?"}])
    (rep,) = [r for r in replicas(gw) if r["node"] == "node-2"]
    assert chat.headers["x-llmgw-replica"] == rep["id"]
    assert len(tried) == 3  # it died three times on node-1 before moving


def test_an_engine_that_never_loads_is_stopped_at_the_start_timeout(
    cluster: Cluster, tmp_path: Path,
) -> None:
    """A vLLM hung in its load (held before it binds its port) is stopped
    once the agent's start timeout passes, says so, and is restarted: loading
    normally this time, it serves."""
    name = f"hung-{uuid.uuid4().hex[:8]}"  # engines are found by it
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / name).touch()
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "1", env_extra={
        "FAKE_VLLM_HOLD_DIR": str(hold), "LLMGW_ENGINE_START_TIMEOUT": "2"})
    key = make_key(gw)
    put_model(gw, name, {"model": "acme/m", "gpus": 1})
    pid = wait_for(lambda: engine_pids("--served-model-name", name), 20, "the engine started")[0]
    started = time.monotonic()

    def timed_out() -> dict[str, Any] | None:
        reps = [r for r in replicas(gw) if "not ready within" in r["detail"]]
        return reps[0] if reps else None

    rep = wait_for(timed_out, 15, "the start timeout in the replica's detail")
    assert time.monotonic() - started >= 1.5  # not stopped before the timeout
    assert rep["detail"].startswith("not ready within 2 s of its start; stopped"), rep["detail"]
    assert "held until" in rep["detail"]  # the engine's last log lines
    assert engine_key(SECRET, rep["id"]) not in rep["detail"]
    assert pid not in engine_pids("--served-model-name", name)

    (hold / name).unlink()  # the next load finishes
    wait_for(lambda: routes(gw, key, name), 20, "routing to the restarted engine")
    assert engine_pids("--served-model-name", name) not in ([], [pid])
