"""The Responses API and vLLM's other routes through real gateways, agents
and vLLM stand-ins (docs/design/responses-api.md):
three gateways on one etcd, two nodes with one replica
each. A response made through one gateway is continued through another and
read through the third, each time on the replica that holds it; once that
replica's node is gone, a continuation gets a 404 that says so. The other
routes answer through the gateway, behind the key's model grants."""

from __future__ import annotations

import io
import signal
import struct
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.procs import (
    Cluster,
    GatewayProc,
    make_key,
    outside_provider,
    put_model,
    replicas,
    wait_for,
)

STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}  # vLLM keeps responses only so


def _wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(struct.pack("<h", 0) * int(seconds * rate))
    return out.getvalue()


def _routed(gw: GatewayProc, count: int) -> bool:
    with gw.admin() as admin:
        r = admin.get("/admin/routes", params={"model": "m"})
    return r.status_code == 200 and len(r.json()["endpoints"]) == count


@pytest.fixture
def fleet(cluster: Cluster) -> tuple[list[GatewayProc], dict[str, object], str]:
    gws = [cluster.gateway(n, node_ttl="3") for n in ("gw-a", "gw-b", "gw-c")]
    agents = {node: cluster.agent(node, gws, "--gpus", "1", env_extra=STORE)
              for node in ("node-1", "node-2")}
    put_model(gws[0], "m", {"model": "acme/m", "gpus": 1, "replicas": {"min": 2, "max": 2}})
    wait_for(lambda: sum(r["phase"] == "ready" for r in replicas(gws[0])) == 2, 60,
             "two ready replicas")
    wait_for(lambda: all(_routed(g, 2) for g in gws), 30, "every gateway routing to both")
    return gws, dict(agents), make_key(gws[0])


def test_a_response_is_continued_on_its_replica_through_any_gateway(
        fleet: tuple[list[GatewayProc], dict[str, object], str]) -> None:
    gws, agents, key = fleet
    a, b, c = (openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0) for g in gws)
    first = a.responses.with_raw_response.create(model="m", input="hello there")
    made = first.parse()
    holder = made.id.rsplit(".", 1)[1]  # resp_<nonce+tag>.<replica>
    assert holder == first.headers["x-llmgw-replica"]
    assert made.output_text == "fake-vllm m echo: hello there (turn 1)"
    # Each turn through another gateway: the chance that a replica drawn at
    # random would have held it four times running is 1 in 16.
    previous = made.id
    for turn, client in enumerate((b, c, a, b), start=2):
        raw = client.responses.with_raw_response.create(
            model="m", input=f"turn {turn}", previous_response_id=previous)
        assert raw.headers["x-llmgw-replica"] == holder
        answer = raw.parse()
        assert answer.output_text.endswith(f"(turn {turn})")
        assert answer.id.rsplit(".", 1)[1] == holder
        previous = answer.id
    assert c.responses.retrieve(made.id).output_text == made.output_text
    # A stream: vLLM's named events, through the gateway, to the end.
    with b.responses.stream(model="m", input="streamed", previous_response_id=previous) as s:
        kinds = [event.type for event in s]
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text.endswith("(turn 6)") and final.usage is not None
    assert final.usage.output_tokens == 6  # "fake-vllm m echo: streamed (turn 6)"

    # Its replica's node dies (agent and engine killed, as a crash): once the
    # gateways drop the replica, a continuation is told what happened.
    node = next(r["node"] for r in replicas(gws[0]) if r["id"] == holder)
    agents[node].signal(signal.SIGKILL)  # type: ignore[attr-defined]
    wait_for(lambda: all(_routed(g, 1) for g in gws), 30, "the replica dropped")
    for client in (a, b, c):
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model="m", input="x", previous_response_id=made.id)
        assert refused.value.code == "replica_gone" and holder in refused.value.message
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)
    # A new conversation is served by the replica left.
    assert a.responses.create(model="m", input="anew").output_text.endswith("(turn 1)")


def test_vllm_s_other_routes_answer_through_the_gateway_behind_the_key(
        fleet: tuple[list[GatewayProc], dict[str, object], str]) -> None:
    gws, _, key = fleet
    client = openai.OpenAI(base_url=gws[1].url + "/v1", api_key=key, max_retries=0)
    heard = client.audio.transcriptions.create(model="m", file=("a.wav", _wav()))
    assert heard.text.startswith("fake-vllm m heard ") and heard.text.endswith("a.wav")
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gws[2].url, headers=auth, timeout=10) as http:
        r = http.post("/v1/rerank", json={"model": "m", "query": "red apple",
                                          "documents": ["sky", "a red apple"]})
        assert r.status_code == 200 and r.json()["results"][0]["index"] == 1
        r = http.post("/score", json={"model": "m", "text_1": "a", "text_2": ["a", "b"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        r = http.post("/tokenize", json={"model": "m", "prompt": "one two three"})
        assert r.status_code == 200 and r.json()["count"] == 3
        tokens = r.json()["tokens"]
        r = http.post("/detokenize", json={"model": "m", "tokens": tokens})
        # The stand-in undoes only ids it gave itself (another replica's
        # come back as `<id>`); the gateway may route the two apart.
        assert r.status_code == 200
        assert r.json()["prompt"] == "one two three" or r.json()["prompt"].count("<") == 3
        assert "x-llmgw-replica" in r.headers
        # Without a key, vLLM's own paths outside /v1 are the gateway's to refuse.
        assert httpx.post(gws[2].url + "/tokenize", json={"model": "m"}).status_code == 401
    with gws[0].admin() as admin:
        r = admin.post("/admin/keys", json={"name": "narrow", "models": ["other"]})
        assert r.status_code == 201, r.text
        narrow = r.json()["key"]
    limited = openai.OpenAI(base_url=gws[0].url + "/v1", api_key=narrow, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        limited.responses.create(model="m", input="x")
    with pytest.raises(openai.NotFoundError):
        limited.audio.transcriptions.create(model="m", file=("a.wav", _wav()))
    r = httpx.post(gws[0].url + "/tokenize", json={"model": "m", "prompt": "x"},
                   headers={"Authorization": f"Bearer {narrow}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.fixture
def keeping_provider(tmp_path: Path) -> Iterator[str]:
    """The vLLM stand-in as an outside provider that keeps its responses
    (key sk-good), as OpenAI's Responses API does."""
    with outside_provider(tmp_path / "provider.log", **STORE) as url:
        yield url


def test_a_provider_s_response_is_continued_by_its_key_alone_through_any_gateway(
        cluster: Cluster, tmp_path: Path, keeping_provider: str) -> None:
    """An external model's response ids are bound to their key with a tag
    every gateway derives from the shared secret: key A's conversation goes
    on through either gateway; key B, given A's id, is told "not found" by
    both, and the provider sees nothing of it. Seen to fail: B continued
    A's conversation at the provider."""
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "provider.key").write_text("sk-good\n")
    gws = [cluster.gateway(n, provider_key_dir=str(keys)) for n in ("gw-a", "gw-b")]
    put_model(gws[0], "ext", {"external": {"url": keeping_provider, "model": "other-model",
                                           "api_key_file": str(keys / "provider.key")}})
    key_a, key_b = make_key(gws[0], "a"), make_key(gws[0], "b")
    a = [openai.OpenAI(base_url=g.url + "/v1", api_key=key_a, max_retries=0) for g in gws]
    b = [openai.OpenAI(base_url=g.url + "/v1", api_key=key_b, max_retries=0) for g in gws]

    def answers() -> bool:
        try:
            return all(c.responses.create(model="ext", input="up?").id for c in a)
        except (openai.NotFoundError, openai.APIStatusError):
            return False

    wait_for(answers, 30, "both gateways serving ext")
    made = a[0].responses.create(model="ext", input="secret plans")
    assert made.output_text == "fake-vllm other-model echo: secret plans (turn 1)"
    for client in b:
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model="ext", input="what did they say?",
                                    previous_response_id=made.id)
        assert refused.value.code == "response_not_found"
    turn = made
    for n, client in enumerate((a[1], a[0], a[1]), start=2):
        turn = client.responses.create(model="ext", input=f"turn {n}",
                                       previous_response_id=turn.id)
        assert turn.output_text.endswith(f"(turn {n})"), turn.output_text
