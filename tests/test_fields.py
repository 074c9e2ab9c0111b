"""The fields the gateway acts on, type-checked at the edge
(app/router/body_fields.py; docs/design/security.md): raw HTTP through a
real all-in-one gateway serving the vLLM stand-in, whose pydantic-like
laxness (`"stream": 1` streams) is what made a loose field escape usage."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.router.body_fields import checked_model
from app.router.own_answers import Reply
from tests.support.procs import FAKE_BIN, Cluster, GatewayProc, serve_one, wait_for

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "count every token"}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    """One gateway serving "m" on the vLLM stand-in; usage written every 0.2 s."""
    c = Cluster(tmp_path_factory.mktemp("fields"), None, "")
    try:
        gw = c.gateway("gw-fields", local_node="gpu-1", local_gpus="1",
                       vllm_bin=str(FAKE_BIN / "vllm"), key_usage_interval="0.2")
        serve_one(gw)
        yield gw
    finally:
        c.close()


def _new_key(gw: GatewayProc) -> tuple[str, str]:
    with gw.admin() as admin:
        r = admin.post("/admin/keys", json={"name": "fields"})
        assert r.status_code == 201, r.text
        return str(r.json()["key"]), str(r.json()["id"])


def _usage(gw: GatewayProc, key_id: str) -> dict[str, Any]:
    with gw.admin() as admin:
        r = admin.get(f"/admin/keys/{key_id}/usage")
        assert r.status_code == 200, r.text
        total: dict[str, Any] = r.json()["total"]
        return total


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"stream": 1}, "stream", "invalid_type"),
    ({"stream": "true"}, "stream", "invalid_type"),
    ({"stream": 0}, "stream", "invalid_type"),
    ({"n": "2"}, "n", "invalid_type"),
    ({"n": True}, "n", "invalid_type"),
    ({"n": 1.0}, "n", "invalid_type"),
    ({"n": 0}, "n", "integer_below_min_value"),
    ({"max_tokens": "16"}, "max_tokens", "invalid_type"),
    ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
    ({"max_completion_tokens": -5}, "max_completion_tokens", "integer_below_min_value"),
    ({"max_completion_tokens": [8]}, "max_completion_tokens", "invalid_type"),
    ({"stream": True, "stream_options": "include_usage"}, "stream_options", "invalid_type"),
    ({"stream": True, "stream_options": {"include_usage": "false"}},
     "stream_options.include_usage", "invalid_type"),
    ({"stream": True, "stream_options": {"include_usage": 0}},
     "stream_options.include_usage", "invalid_type"),
    ({"model": ["m"]}, "model", "invalid_type"),
    ({"model": 7}, "model", "invalid_type"),
]


def test_a_field_of_the_wrong_form_is_400_naming_it_and_charges_nothing(
        gw: GatewayProc) -> None:
    key, key_id = _new_key(gw)
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    for fields, param, code in BAD:
        raw = json.dumps({"model": "m", "messages": MESSAGES} | fields).encode()
        r = httpx.post(gw.url + CHAT, content=raw, headers=auth, timeout=10)
        assert r.status_code == 400, (fields, r.status_code, r.text[:200])
        assert r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert (err["param"], err["code"], err["type"]) == (param, code,
                                                            "invalid_request_error"), fields
        assert f"'{param}'" in err["message"]

    # The same fields in their own form pass, and a stream sent raw is
    # counted: the stand-in's usage reaches the key's record.
    good = {"model": "m", "messages": MESSAGES, "stream": True, "n": 1, "max_tokens": 16,
            "max_completion_tokens": None, "stream_options": {"include_usage": None}}
    with httpx.stream("POST", gw.url + CHAT, content=json.dumps(good).encode(),
                      headers=auth, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all('"usage": {' not in e and '"usage":{' not in e for e in events)
    usage = wait_for(lambda: (u := _usage(gw, key_id))["requests"] == 1 and u, 10,
                     "the stream's usage written")
    # Refused requests are not admitted: only the stream counts, with its tokens
    # (one an event, less the first, role only, and [DONE]).
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] == len(events) - 2
    assert usage["estimated"] == 0


def test_null_means_the_default_and_other_fields_pass_as_sent() -> None:
    body: dict[str, Any] = {"model": "m", "stream": None, "n": None, "max_tokens": None,
                            "stream_options": None, "temperature": "hot", "seed": "x"}
    assert checked_model(body) == "m"
    assert body["temperature"] == "hot"  # not ours to judge: the engine answers it
    for missing in ({}, {"model": ""}, {"model": None}):
        with pytest.raises(Reply) as refused:
            checked_model(missing)
        err = json.loads(refused.value.body)["error"]
        assert refused.value.status == 400 and err["param"] == "model"
        assert err["message"] == "You must provide a model parameter."
