"""OpenAPI entries for /v1, which FastAPI does not route (app/gateway/main.py).

They say what the plain ASGI router (proxy.py) really takes and answers:
the body fields it type-checks (body_fields.py) with the same types, the
statuses it answers itself, and OpenAI's error shape. Anything else in a
body is the engine's to judge, and its own answers pass through.
Schemathesis checks this against the running gateway in CI
(tests/test_schema_fuzz.py, docs/design/errors.md).
"""

from __future__ import annotations

from typing import Any

_JSON = "application/json"


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_COUNT = _nullable({"type": "integer", "minimum": 1})
_BODY: dict[str, Any] = {
    "type": "object", "required": ["model"],
    "description": "OpenAI's request body; the gateway checks these fields, the engine the rest",
    "properties": {
        "model": {"type": "string", "minLength": 1, "description": "a model name or alias"},
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_usage": _nullable({"type": "boolean"})}}),
        "n": _COUNT, "max_tokens": _COUNT, "max_completion_tokens": _COUNT,
    },
}
_RESPONSES_BODY: dict[str, Any] = {**_BODY, "properties": {
    **_BODY["properties"], "previous_response_id": _nullable({"type": "string"})}}
# Speech to text: a form; the gateway reads the model and stream fields and
# that a file is there (multipart_form.py), the engine the rest.
_FORM: dict[str, Any] = {
    "type": "object", "required": ["file", "model"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "model": {"type": "string", "minLength": 1,
                             "description": "a model name or alias"},
                   "stream": {"type": "string", "enum": ["true", "false"]}},
}
_ERROR: dict[str, Any] = {
    "type": "object", "required": ["error"], "title": "OpenAIError",
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
_MODEL: dict[str, Any] = {
    "type": "object", "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"},
                   "root": {"type": "string", "description": "the catalog name"},
                   "parent": {"type": "string",
                              "description": "a LoRA adapter's base model (adapters only)"}},
}
_LIST: dict[str, Any] = {
    "type": "object", "required": ["object", "data"],
    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _MODEL}},
}
_WHY = {
    400: "a field the gateway reads has the wrong type or value, the body is not a JSON "
         "object; or the engine refused the request",
    401: "missing, wrong or expired client key",
    404: "unknown model, or one this key may not use; a response not found, or whose "
         "replica is gone (replica_gone); a route the model's engine does not serve "
         "(unsupported_endpoint: llama.cpp serves chat, completions and embeddings)",
    405: "the path takes another method",
    413: "the body is over 32 MiB",
    429: "the key is over a limit (Retry-After says when to retry)",
    502: "the replica refused the gateway, or broke off",
    503: "no ready replica, too many waiting for one, or the gateway is stopping",
    504: "the engine did not answer in time (upstream_timeout)",
}


def _errors(*codes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for code in codes:
        out[str(code)] = {"description": _WHY[code],
                          "content": {_JSON: {"schema": _ERROR}}}
    out.get("429", {})["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    out.get("401", {})["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return out


def _op(summary: str, ok: dict[str, Any], *codes: int) -> dict[str, Any]:
    return {"tags": ["OpenAI API"], "summary": summary, "security": [{"ClientKey": []}],
            "responses": {"200": ok, **_errors(401, *codes)}}


def _forwarded(summary: str, body: dict[str, Any] = _BODY, kind: str = _JSON,
               streams: bool = True) -> dict[str, Any]:
    answer = ("the engine's answer, as OpenAI's API; an SSE stream when the body asks for one"
              if streams else "the engine's answer, read whole (vLLM's API)")
    content: dict[str, Any] = {_JSON: {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    if kind != _JSON:  # speech to text: response_format text answers plain text
        content["text/plain"] = {"schema": {"type": "string"}}
    entry = _op(summary, {"description": answer, "content": content},
                400, 404, 413, 429, 502, 503, 504)
    entry["requestBody"] = {"required": True, "content": {kind: {"schema": body}}}
    return {"post": entry}


def _stored(summary: str, method: str) -> dict[str, Any]:
    """GET /v1/responses/{response_id} and its cancel: to the replica holding it."""
    entry = _op(summary, {"description": "the stored response, from the replica that made "
                          "it", "content": {_JSON: {"schema": {"type": "object"}},
                                            "text/event-stream": {"schema": {"type": "string"}}}},
                404, 405, 429, 502, 503, 504)
    entry["parameters"] = [{"name": "response_id", "in": "path", "required": True,
                            "schema": {"type": "string", "minLength": 1}}]
    return {method: entry}


def _passthrough_paths() -> dict[str, Any]:
    """vLLM's other routes (passthrough.py), each routed by its model."""
    out: dict[str, Any] = {
        "/v1/responses": _forwarded("Responses API, forwarded to a replica (a continuation "
                                    "to the replica holding its previous response)",
                                    _RESPONSES_BODY),
        "/v1/responses/{response_id}": _stored("A stored response", "get"),
        "/v1/responses/{response_id}/cancel": _stored("Cancel a background response",
                                                      "post"),
    }
    for path, what in (("/v1/rerank", "Rerank"), ("/rerank", "Rerank (vLLM's path)"),
                       ("/v2/rerank", "Rerank (Cohere's v2 path)"), ("/v1/score", "Score"),
                       ("/score", "Score (vLLM's path)"), ("/tokenize", "Tokenize"),
                       ("/detokenize", "Detokenize")):
        out[path] = _forwarded(f"{what}, forwarded to a replica", streams=False)
    for path, what in (("/v1/audio/transcriptions", "Transcription"),
                       ("/v1/audio/translations", "Translation")):
        out[path] = _forwarded(f"{what} of an audio file, forwarded to a replica", _FORM,
                               "multipart/form-data")
    return out


def openapi_paths() -> dict[str, Any]:
    """The /v1 paths, merged into FastAPI's by `main.create_app`."""
    one = _op("One model, by name or alias",
              {"description": "the model", "content": {_JSON: {"schema": _MODEL}}}, 404)
    one["parameters"] = [{"name": "model", "in": "path", "required": True,
                          "schema": {"type": "string", "minLength": 1}}]
    return {
        "/v1/models": {"get": _op(
            "List the models this key may use",
            {"description": "the models", "content": {_JSON: {"schema": _LIST}}})},
        "/v1/models/{model}": {"get": one},
        "/v1/chat/completions": _forwarded("Chat completion, forwarded to a replica"),
        "/v1/completions": _forwarded("Text completion, forwarded to a replica"),
        "/v1/embeddings": _forwarded("Embeddings, forwarded to a replica"),
    } | _passthrough_paths()


def complete(schema: dict[str, Any]) -> dict[str, Any]:
    """Adds /v1's paths and its client key's security scheme to `schema`."""
    schema["paths"] = openapi_paths() | schema["paths"]
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["ClientKey"] = {
        "type": "http", "scheme": "bearer", "description": "a client key (POST /admin/keys)"}
    return schema
