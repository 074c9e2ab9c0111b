"""The request path across processes: retries before the first byte, a
client walking away (the engine aborts), an engine dying mid-stream (the
official client raises), embeddings end to end. The logic of each is tested
in-process in tests/test_request_life.py; here, what only real processes
show (uvicorn's disconnect, a killed engine's socket, the SDK over HTTP)."""

from __future__ import annotations

import signal
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.router.choice import ring_order
from tests.fakes.fake_vllm import fake_embedding
from tests.support.procs import (
    FAKE_BIN,
    Cluster,
    kill_engine,
    make_key,
    put_model,
    replicas,
    routes,
    wait_for,
)


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus samples at `url`/metrics, by name and sorted labels."""
    r = httpx.get(url + "/metrics", timeout=5)
    r.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def engine_figures(url: str) -> tuple[float, float]:
    """An engine's requests running and requests aborted (vLLM's metrics)."""
    m = samples(url)
    running = [v for (name, _), v in m.items() if name == "vllm:num_requests_running"]
    aborted = [v for (name, labels), v in m.items()
               if name == "vllm:request_success_total" and ("finished_reason", "abort") in labels]
    return running[0], aborted[0]


def requests_counted(gw_url: str, model: str, code: int) -> float:
    return samples(gw_url).get(
        ("llmgw_requests_total", (("code", str(code)), ("model", model))), 0.0)


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
        # Each request its own conversation, so affinity spreads them over the
        # ring: until the dead replica has been chosen (and the request retried)
        # at least once, and no fewer than 6 (20 make missing it ~1e-6).
        for i in range(20):
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": f"still here {i}"}])
            assert raw.headers["x-llmgw-replica"] == live["id"]
            assert f"still here {i}" in (raw.parse().choices[0].message.content or "")
            if i >= 5 and f"replica {dead['id']} failed (" in gw.output():
                break
        assert [r["id"] for r in replicas(gw) if r["phase"] == "ready"] == [dead["id"], live["id"]]
    finally:
        agent.signal(signal.SIGCONT)
    # The dead one was chosen, and the request retried on the live one.
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


def test_embeddings_through_a_gateway_with_the_openai_client(solo: Cluster) -> None:
    gw = solo.gateway("emb", local_node="gpu-1", local_gpus="1",
                      vllm_bin=str(FAKE_BIN / "vllm"))
    key = make_key(gw)
    put_model(gw, "emb", {"model": "acme/embedder", "aliases": ["e"], "gpus": 1})
    wait_for(lambda: routes(gw, key, "emb"), 30, "routing")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    texts = ["hello world", "a second text here"]
    # The client asks for base64 unless told otherwise, and decodes it itself.
    for fmt in (openai.NOT_GIVEN, "float"):
        raw = client.embeddings.with_raw_response.create(model="e", input=texts,
                                                         encoding_format=fmt)
        assert raw.headers["x-llmgw-replica"] == replicas(gw)[0]["id"]
        answer = raw.parse()
        assert answer.model == "emb"  # the alias reached the engine as the catalog name
        assert [d.index for d in answer.data] == [0, 1]
        assert [d.embedding for d in answer.data] == [fake_embedding("emb", t) for t in texts]
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == 6
    with pytest.raises(openai.BadRequestError, match="matryoshka"):  # the engine's 400, passed on
        client.embeddings.create(model="emb", input="x", dimensions=8)


@pytest.fixture
def slow_engine(cluster: Cluster) -> tuple[str, str, str]:
    """A gateway and a replica whose engine takes 0.2 s a word: (gateway URL,
    client key, engine URL)."""
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "1", env_extra={"FAKE_VLLM_TOKEN_DELAY": "0.2"})
    key = make_key(gw)
    put_model(gw, "slow", {"model": "acme/slow", "gpus": 1})
    wait_for(lambda: routes(gw, key, "slow"), 30, "routing")
    return gw.url, key, str(replicas(gw)[0]["url"])


LONG = {"role": "user", "content": " ".join(["word"] * 40)}


def test_a_client_leaving_a_plain_request_aborts_the_engine_within_1s(
        slow_engine: tuple[str, str, str]) -> None:
    gw_url, key, engine_url = slow_engine
    assert engine_figures(engine_url) == (0, 0)
    # 44 words at 0.2 s: about 9 s of generation, and a client that gives up after 1.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw_url + "/v1/chat/completions", timeout=1,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": "slow", "messages": [LONG]})
    left = time.monotonic()
    wait_for(lambda: engine_figures(engine_url) == (0, 1), 1, "the engine aborting it")
    print(f"engine aborted {time.monotonic() - left:.2f} s after the client left")
    wait_for(lambda: requests_counted(gw_url, "slow", 499) == 1, 5, "a 499 counted")
    assert requests_counted(gw_url, "slow", 200) == 1  # routes()' request only


def test_an_engine_killed_mid_stream_makes_the_openai_client_raise(
        slow_engine: tuple[str, str, str]) -> None:
    gw_url, key, engine_url = slow_engine
    client = openai.OpenAI(base_url=gw_url + "/v1", api_key=key, max_retries=0)
    stream = client.chat.completions.create(model="slow", messages=[LONG],
                                            stream=True)
    words = []
    with pytest.raises(openai.APIError, match="broke off the stream") as caught:
        for chunk in stream:
            words.append(chunk.choices[0].delta.content)
            if len(words) == 3:
                kill_engine(engine_url)
    assert 3 <= len(words) < 40  # a short answer, but never mistaken for a whole one
    assert caught.value.body == {"message": caught.value.message, "type": "server_error",
                                 "param": None, "code": "upstream_error"}
    wait_for(lambda: requests_counted(gw_url, "slow", 502) == 1, 5, "a 502 counted")


def test_sessions_stick_to_a_replica_and_routes_explain_the_choice(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "2")
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1, "replicas": {"min": 2, "max": 2}})
    wait_for(lambda: len([r for r in replicas(gw) if r["phase"] == "ready"]) == 2, 30,
             "two ready replicas")

    def explained() -> list[dict[str, Any]] | None:
        with gw.admin() as admin:
            rows = admin.get("/admin/routes", params={"model": "m"}).json()["endpoints"]
        # Both routed, with the engines' own counts polled from their /metrics.
        return rows if len(rows) == 2 and all(r["engine"] for r in rows) else None

    rows = wait_for(explained, 15, "both endpoints with engine loads")
    assert {r["why"] for r in rows} == {"candidate"}
    assert abs(sum(float(r["affinity_share"]) for r in rows) - 1.0) < 1e-6

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)

    def served_by(session: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}],
            extra_headers={"X-Session-Id": session})
        return raw.headers["x-llmgw-replica"]

    for session in ("alice", "bob"):
        assert len({served_by(session) for _ in range(8)}) == 1  # one replica per session
    # Each session goes where the ring puts it: the same answer every gateway
    # works out. Thirty-two sessions all on one replica of two would be a
    # one-in-a-billion ring (16 were one in 20,000, and CI met one).
    ids = [r["replica"] for r in rows]
    homes = {f"user-{i}": served_by(f"user-{i}") for i in range(32)}
    assert homes == {s: ring_order(ids, "s:" + s)[0] for s in homes}
    assert set(homes.values()) == set(ids)  # sessions spread over both
