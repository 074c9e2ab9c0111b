"""The /v1 OpenAPI says what the router really takes (app/router/openapi.py).

Checked in-process against the router's own field checks: a body the
schema accepts is one `checked_model` accepts, and the other way round.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.gateway.main import create_app
from app.gateway.settings import Settings
from app.router.body_fields import checked_model
from app.router.multipart_form import form_fields
from app.router.own_answers import Reply, error
from app.router.passthrough import checked_previous


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("spec"), admin_token="a" * 20,
                              local_agent=False))
    return dict(app.openapi())


def test_every_templated_path_declares_its_parameters(spec: dict[str, Any]) -> None:
    for path, item in spec["paths"].items():
        for method, op in item.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == set(re.findall(r"{(\w+)}", path)), f"{method} {path}"
    assert {"/v1/models/{model}", "/v1/responses/{response_id}"} <= set(spec["paths"])


_VALUES = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) \
    | st.text(max_size=3) | st.lists(st.integers(), max_size=2) \
    | st.dictionaries(st.sampled_from(["include_usage", "x"]),
                      st.none() | st.booleans() | st.integers(0, 1) | st.text(max_size=2))
_FIELDS = ("model", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens",
           "messages")


def _accepted(body: dict[str, Any]) -> bool:
    try:
        checked_model(body)
    except Reply:
        return False
    return True


@pytest.fixture(scope="module")
def body_validators(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(path, jsonschema_rs.validator_for(
        spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]))
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                     "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score", "/tokenize",
                     "/detokenize")]


@given(body=st.dictionaries(st.sampled_from((*_FIELDS, "previous_response_id", "input")),
                            _VALUES))
@settings(max_examples=300, derandomize=True, database=None, deadline=None)
def test_the_responses_body_schema_is_what_the_router_checks(spec: dict[str, Any],
                                                             body: dict[str, Any]) -> None:
    schema = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    try:
        checked_model(body)
        checked_previous(body)
        accepted = True
    except Reply:
        accepted = False
    assert jsonschema_rs.validator_for(schema).is_valid(body) == accepted, body


def test_the_form_schema_is_what_the_router_checks(spec: dict[str, Any]) -> None:
    schema = spec["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"][
        "multipart/form-data"]["schema"]
    assert schema["required"] == ["file", "model"]
    assert schema["properties"]["stream"]["enum"] == ["true", "false"]
    for fields, ok in (({"model": "m"}, True), ({"model": "m", "stream": "true"}, True),
                       ({"model": ""}, False), ({"model": "m", "stream": "1"}, False)):
        req = httpx.Request("POST", "http://x/", files={"file": ("a", b"1")}, data=fields)
        try:
            form_fields(req.read(), req.headers["content-type"])
            accepted = True
        except Reply:
            accepted = False
        valid = jsonschema_rs.validator_for(schema).is_valid({"file": "a", **fields})
        assert valid == accepted == ok, fields


@given(body=st.dictionaries(st.sampled_from(_FIELDS), _VALUES))
@settings(max_examples=400, derandomize=True, database=None, deadline=None)
def test_the_body_schema_is_what_the_router_checks(body_validators: list[tuple[str, Any]],
                                                  body: dict[str, Any]) -> None:
    for path, validator in body_validators:
        assert validator.is_valid(body) == _accepted(body), (path, body)


def test_the_documented_errors_are_the_router_s(spec: dict[str, Any]) -> None:
    reply = error(400, "Invalid type for 'stream'", "invalid_request_error", "invalid_type",
                  "stream")
    for path, item in spec["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for op in item.values():
            assert {"401"} <= set(op["responses"]), path
            for code, answer in op["responses"].items():
                if code != "200":
                    schema = answer["content"]["application/json"]["schema"]
                    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(reply.body))
    post = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "429", "503", "504"} <= set(post)
    assert "Retry-After" in post["429"]["headers"]

