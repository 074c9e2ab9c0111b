"""The whole path: admin PUT -> leader places -> agent starts the engine ->
the official openai client gets answers through every gateway."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.procs import (
    Cluster,
    GatewayProc,
    make_key,
    put_model,
    replicas,
    routes,
    wait_for,
    wait_ready,
)


@pytest.fixture
def fleet(cluster: Cluster) -> tuple[list[GatewayProc], str]:
    gws = [cluster.gateway(n) for n in ("gw-a", "gw-b", "gw-c")]
    cluster.agent("node-1", gws, "--gpus", "2")
    wait_for(lambda: gws[0].admin().get("/admin/nodes").json(), 15, "node-1 registered")
    return gws, make_key(gws[0])


def test_vllm_replica_serves_through_every_gateway(
    fleet: tuple[list[GatewayProc], str],
) -> None:
    gws, key = fleet
    spec = {"model": "acme/tiny-chat", "aliases": ["tiny"], "engine": "vllm", "gpus": 1,
            "replicas": {"min": 1, "max": 1}}
    put_model(gws[1], "tiny-chat", spec)
    rep = wait_ready(gws[2])
    assert rep["model"] == "tiny-chat" and rep["node"] == "node-1" and len(rep["gpus"]) == 1
    assert rep["url"].startswith("http://127.0.0.1:")
    with gws[0].admin() as admin:
        status = admin.get("/admin/models/tiny-chat").json()["status"]
    assert status == {"wanted": 1, "replicas": 1, "ready": 1, "failed": [],
                      "unplaced": None, "placement": None,
                      "health": {"state": "ok", "detail": "", "reasons": {}}}

    for gw in gws:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        # Every gateway's router learns of the ready replica through its watch.
        wait_for(lambda g=gw: routes(g, key, "tiny"), 5, f"{gw.name} routing")
        for name in ("tiny-chat", "tiny"):
            chat = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": f"hello via {gw.name}"}])
            assert chat.choices[0].message.content is not None
            assert f"hello via {gw.name}" in chat.choices[0].message.content
            assert chat.model == "tiny-chat"

            stream = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "stream me"}], stream=True)
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
            assert "stream me" in text

            comp = client.completions.create(model=name, prompt="once upon", max_tokens=20)
            assert "once upon" in comp.choices[0].text
            pieces = [c.choices[0].text for c in client.completions.create(
                model=name, prompt="a time", max_tokens=20, stream=True)]
            assert len(pieces) > 1 and "a time" in "".join(pieces)

    # The engine itself refuses a request that does not bear its key.
    r = httpx.post(rep["url"] + "/v1/chat/completions",
                   json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401
    r = httpx.post(rep["url"] + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401

    # Deleting the model stops its replica.
    with gws[0].admin() as admin:
        assert admin.delete("/admin/models/tiny-chat").status_code == 204
    wait_for(lambda: not replicas(gws[0]), 15, "the replica removed")
    wait_for(lambda: _down(rep["url"]), 15, "the engine stopped")


def _down(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
        return False
    except httpx.TransportError:
        return True


def test_a_profiles_engine_args_and_revision_reach_the_engine(cluster: Cluster) -> None:
    from tests.support.procs import engine_pid

    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "1")
    key = make_key(gw)
    put_model(gw, "tuned", {
        "model": "acme/tuned", "revision": "v2",
        "profiles": [{"engine": "vllm", "gpus": 1, "gpu_memory_utilization": 0.85,
                      "max_model_len": 4096, "engine_args": ["--enforce-eager"]}]})
    rep = wait_ready(gw)
    wait_for(lambda: routes(gw, key, "tuned"), 10, "routing")
    with open(f"/proc/{engine_pid(rep['url'])}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    assert argv[argv.index("--revision") + 1] == "v2"
    assert "--max-model-len=4096" in argv and "--enforce-eager" in argv
    assert "--gpu-memory-utilization=0.85" in argv  # the profile's fields, as vLLM's flags
