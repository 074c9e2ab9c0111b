"""What /admin and /agent/v1 answer besides their 200s, in the OpenAPI.

FastAPI documents a route's success and a 422 in its own validation shape;
the gateway also answers 401 (app/api/edge.py, before the body), 413 (the
edge's body cap), 503 (state not loaded, store unavailable or full) and
each route's own refusals, all as RFC 9457 problem JSON (app/api/errors.py).
Routes name their own refusals with `problems(...)`; `complete()` adds what
every route may answer. Schemathesis checks the result in CI
(tests/test_schema_fuzz.py, docs/design/errors.md).
"""

from __future__ import annotations

from typing import Any

PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object", "title": "Problem",
    "description": "RFC 9457 problem details",
    "required": ["type", "title", "status"],
    "properties": {"type": {"type": "string"}, "title": {"type": "string"},
                   "status": {"type": "integer"}, "detail": {"type": "string"}},
}

_WHY = {
    400: "the request names something invalid, or its body is not JSON",
    401: "missing or wrong token",
    404: "no such object",
    408: "past the client's X-Request-Deadline or the gateway's write bound: nothing written",
    409: "conflict, or the state kept changing under the request: retry",
    412: "If-Match or If-None-Match does not hold: the record changed since it was read",
    413: "the request body is over the route's cap",
    422: "the body or a parameter does not validate",
    502: "the node's agent failed or refused",
    503: "state not loaded yet, or the store did not answer or is out of space",
    504: "the node's agent did not answer in time",
}


def problems(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for a route's own refusals, in problem JSON."""
    return {code: {"description": _WHY[code], "content": {"application/problem+json": {
        "schema": {"$ref": "#/components/schemas/Problem"}}}} for code in codes}


def complete(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with what every /admin and /agent/v1 route may answer."""
    schema.setdefault("components", {}).setdefault("schemas", {})["Problem"] = PROBLEM_SCHEMA
    for path, item in schema.get("paths", {}).items():
        if not (path.startswith("/admin/") or path.startswith("/agent/v1/")):
            continue
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            # A body FastAPI cannot parse (not JSON, not UTF-8) is a 400.
            codes = [401, 503] + ([400, 413] if "requestBody" in op else [])
            if path.startswith("/admin/") and method in ("put", "post", "delete"):
                codes += [408, 412]  # deadlines and conditions (app/api/writes.py)
            if "422" in responses or "parameters" in op or "requestBody" in op:
                codes.append(422)
            for code, entry in problems(*codes).items():
                responses[str(code)] = entry  # 422: ours, not FastAPI's shape
            if path.startswith("/agent/v1/"):
                op["security"] = [{"NodeToken": []}]
    schema["components"].setdefault("securitySchemes", {})["NodeToken"] = {
        "type": "http", "scheme": "bearer",
        "description": "the node's agent token (llmgw ctl node-token NODE)"}
    return schema
