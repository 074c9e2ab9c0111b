"""The vLLM stand-in's Responses API, rerank, score and speech to text, as
vLLM serves them (tests/fakes/fake_vllm_responses.py says what was checked)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.test_fake_vllm import Proc, _env, _spawn, _stop, _wait_healthy

KEY = "engine-key"


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """One that stores responses (VLLM_ENABLE_RESPONSES_API_STORE=1), one that does not."""
    work = tmp_path_factory.mktemp("fake-routes")
    args = ["--served-model-name", "m", "--api-key", KEY]
    storing = _spawn(work, args, _env(VLLM_ENABLE_RESPONSES_API_STORE="1"))
    plain = _spawn(work, args, _env())
    try:
        yield _wait_healthy(storing), _wait_healthy(plain)
    finally:
        _stop(storing)
        _stop(plain)


def _client(p: Proc) -> httpx.Client:
    return httpx.Client(base_url=p.base, timeout=10, headers={"Authorization": f"Bearer {KEY}"})


def test_a_stored_response_is_continued_read_and_not_cancelled(fakes: tuple[Proc, Proc]) -> None:
    storing, plain = fakes
    with _client(storing) as c, _client(plain) as other:
        first = c.post("/v1/responses", json={"model": "m", "input": "hello there",
                                              "request_id": "resp_mine"})
        assert first.status_code == 200, first.text
        made = first.json()
        assert made["id"] == "resp_mine" and made["object"] == "response"
        assert made["output"][0]["content"][0]["text"] == "fake-vllm m echo: hello there (turn 1)"
        assert made["usage"]["input_tokens"] == 3 and made["usage"]["output_tokens"] == 7
        second = c.post("/v1/responses", json={"model": "m", "input": "again",
                                               "previous_response_id": "resp_mine"})
        assert second.status_code == 200, second.text
        assert second.json()["output"][0]["content"][0]["text"].endswith("(turn 2)")
        assert c.get("/v1/responses/resp_mine").json() == made
        r = c.post("/v1/responses/resp_mine/cancel")
        assert r.status_code == 400 and "synchronous" in r.json()["error"]["message"]
        # Another engine, or one whose store is off (vLLM's default), knows nothing of it.
        for client in (other, c):
            r = client.post("/v1/responses", json={"model": "m", "input": "x",
                                                   "previous_response_id": "resp_nope"})
            assert r.status_code == 404
            assert r.json()["error"] == {"message": "Response with id 'resp_nope' not found.",
                                         "type": "invalid_request_error",
                                         "param": "response_id", "code": 404}
        plain_made = other.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
        assert other.get(f"/v1/responses/{plain_made['id']}").status_code == 404


def test_a_response_streams_named_events_ending_with_its_usage(
        fakes: tuple[Proc, Proc]) -> None:
    with _client(fakes[0]) as c:
        r = c.post("/v1/responses", json={"model": "m", "input": "one two", "stream": True})
        assert r.status_code == 200
        events = [block.split("\n") for block in r.text.strip().split("\n\n")]
        kinds = [lines[0].removeprefix("event: ") for lines in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds and "[DONE]" not in r.text
        last = json.loads(events[-1][1].removeprefix("data: "))
        assert last["response"]["usage"]["output_tokens"] == 7
        assert [json.loads(e[1][6:])["sequence_number"] for e in events] == list(
            range(len(events)))


def test_rerank_score_and_audio_answer_in_vllm_s_shapes(fakes: tuple[Proc, Proc]) -> None:
    with _client(fakes[0]) as c:
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = c.post(path, json={"model": "m", "query": "red apple",
                                   "documents": ["blue sky", "a red apple", "green"],
                                   "top_n": 2})
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["results"][0]["index"] == 1 and len(got["results"]) == 2
            assert got["usage"]["total_tokens"] == 12 and got["id"].startswith("rerank-")
        r = c.post("/v1/score", json={"model": "m", "text_1": "a b", "text_2": ["a b", "c"]})
        assert r.status_code == 200
        data = r.json()["data"]
        assert [d["object"] for d in data] == ["score", "score"]
        assert data[0]["score"] > data[1]["score"]
        r = c.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"\0" * 64000)},
                   data={"model": "m"})
        assert r.status_code == 200, r.text
        assert r.json() == {"text": "fake-vllm m heard 64000 bytes of a.wav",
                            "usage": {"type": "duration", "seconds": 2}}
        r = c.post("/v1/audio/transcriptions", files={"file": ("a.wav", b"\0")},
                   data={"model": "m", "stream": "true"})
        assert r.text.endswith("data: [DONE]\n\n") and "transcription.chunk" in r.text
        assert c.post("/v1/audio/transcriptions", data={"model": "m"}).status_code == 400
