"""Schemathesis over the gateway's own OpenAPI: no 5xx, answers as documented.

A real all-in-one gateway (embedded store, no local agent) serves
/openapi.json; every operation of `/admin`, `/agent/v1` and `/v1` gets
valid and invalid inputs (docs/design/errors.md), each with the
credential its path group takes: the admin token on /admin, a client key
on /v1, and on /agent/v1/nodes/{node} the token of the node it names, the
one path parameter pinned (any other node's name is a 401 before the body).
Checks: not_a_server_error (any 5xx fails, and the gateway must log no
traceback), status_code_conformance, content_type_conformance and
response_schema_conformance. Nothing is excluded: no agent runs, so what
reaches a node (logs, weights, upgrade, fabric-test) ends at the gateway
(404 unknown node, 422), and the store is this test's own.

Bounded and derandomized for CI: EXAMPLES per operation and mode (valid,
then invalid input), no shrinking (the failure shown is the first found),
one failure per operation and mode, all of them listed at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from app.router.passthrough import ROOT_PATHS
from app.wire.tokens import node_token
from tests.support.procs import ADMIN, SECRET, Cluster, GatewayProc, make_key

NODE = "fuzz-node"
EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProc, str]]:
    """An all-in-one gateway and a client key of it."""
    c = Cluster(tmp_path_factory.mktemp("fuzz"), None, "")
    try:
        gw = c.gateway("fuzz", local_agent="false")
        yield gw, make_key(gw, "fuzz")
    finally:
        c.close()


def _credential(path: str, key: str) -> str:
    if path.startswith("/v1/") or path in ROOT_PATHS:  # /tokenize...: vLLM's, no /v1
        return key
    if path.startswith("/agent/v1/"):
        return node_token(SECRET, NODE)
    return ADMIN


def _fuzz(operation: Any, mode: GenerationMode, url: str, key: str,
          http: requests.Session) -> str | None:
    """The first failure of `operation` under `mode`, if any."""
    pinned = {"node": NODE} if operation.path.startswith("/agent/v1/nodes/{node}") else None
    headers = {"Authorization": f"Bearer {_credential(operation.path, key)}"}

    @given(case=operation.as_strategy(mode, path_parameters=pinned))
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        case.call_and_validate(base_url=url, session=http, headers=headers, checks=CHECKS,
                               timeout=30)

    started = time.monotonic()
    try:
        run()
    except Unsatisfiable:
        return None  # nothing to make invalid: no parameters, body nor credential
    except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup
        return f"{mode.value} {operation.label}: {exc}"
    finally:
        print(f"{time.monotonic() - started:6.2f}s {mode.value} {operation.label}")
    return None


# Requests that succeed, which random input seldom makes: each answer is
# checked like the fuzzed ones, and must have the status given.
_SUCCESSES: list[tuple[str, str, dict[str, Any], dict[str, Any] | None, int]] = [
    ("PUT", "/admin/models/{name}", {"name": "fuzz-m"}, {"model": "acme/m", "gpus": 1}, 201),
    ("PUT", "/admin/models/{name}", {"name": "fuzz-m"},
     {"model": "acme/m", "gpus": 1, "aliases": ["fuzz-alias"]}, 200),
    ("GET", "/admin/models/{name}", {"name": "fuzz-m"}, None, 200),
    ("GET", "/v1/models", {}, None, 200),
    ("GET", "/v1/models/{model}", {"model": "fuzz-alias"}, None, 200),
    ("PUT", "/agent/v1/nodes/{node}", {"node": NODE}, {"name": NODE}, 200),
    ("GET", "/admin/nodes/{node}/conf", {"node": NODE}, None, 200),
    ("POST", "/admin/nodes/{node}/cordon", {"node": NODE}, None, 200),
    ("POST", "/admin/nodes/{node}/uncordon", {"node": NODE}, None, 200),
    ("GET", "/agent/v1/nodes/{node}/assignments", {"node": NODE}, None, 200),
    ("PUT", "/agent/v1/nodes/{node}/status", {"node": NODE}, {"replicas": []}, 200),
    ("GET", "/admin/catalog", {}, None, 200),
    ("PUT", "/admin/quotas/{scope}", {"scope": "fuzz-m"}, {"max_gpus": 1}, 200),
    ("DELETE", "/admin/quotas/{scope}", {"scope": "fuzz-m"}, None, 204),
    ("DELETE", "/admin/models/{name}", {"name": "fuzz-m"}, None, 204),
]


def test_successes_answer_as_documented(gateway: tuple[GatewayProc, str]) -> None:
    gw, key = gateway
    schema = schemathesis.openapi.from_url(gw.url + "/openapi.json")
    with requests.Session() as http:
        for method, path, params, body, status in _SUCCESSES:
            op = schema[path][method]
            case = op.Case(path_parameters=params, **({} if body is None else {"body": body}))
            headers = {"Authorization": f"Bearer {_credential(path, key)}"}
            r = case.call_and_validate(base_url=gw.url, session=http, headers=headers,
                                       checks=CHECKS, timeout=30)
            assert r.status_code == status, (method, path, r.text)
        made = schema["/admin/keys"]["POST"].Case(body={"name": "fuzz-k"}).call_and_validate(
            base_url=gw.url, session=http, headers={"Authorization": f"Bearer {ADMIN}"},
            checks=CHECKS, timeout=30)
        assert made.status_code == 201, made.text
        for method, path, status in (("GET", "/admin/keys/{key_id}", 200),
                                     ("GET", "/admin/keys/{key_id}/usage", 200),
                                     ("DELETE", "/admin/keys/{key_id}", 204)):
            r = schema[path][method].Case(path_parameters={"key_id": made.json()["id"]}
                                          ).call_and_validate(
                base_url=gw.url, session=http, headers={"Authorization": f"Bearer {ADMIN}"},
                checks=CHECKS, timeout=30)
            assert r.status_code == status, (method, path, r.text)


# Every operation twice, over 100 of them: 3 minutes on an idle 2-core
# machine, past the default 300 s at a load of 13.
@pytest.mark.timeout(600)
def test_every_operation_answers_as_documented(gateway: tuple[GatewayProc, str]) -> None:
    gw, key = gateway
    url = gw.url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "GET /v1/models/{model}", "POST /v1/chat/completions", "PUT /agent/v1/nodes/{node}",
        "POST /admin/keys", "POST /v1/responses", "GET /v1/responses/{response_id}",
        "POST /v1/audio/transcriptions", "POST /tokenize"}
    failures = []
    with requests.Session() as http:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                failure = _fuzz(operation, mode, url, key, http)
                if failure is not None:
                    failures.append(failure)
    assert not failures, "\n\n".join(failures)
    assert "Traceback" not in gw.output(), gw.output()[-5000:]
