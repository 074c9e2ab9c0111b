"""What an operator meets first, through a real gateway process serving the
vLLM stand-in, with the official openai client: /health as vLLM answers it,
request ids end to end, the access line, JSON logs from every process, the
trace context passed to the engine. docs/design/routing.md and docs/design/logs.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.procs import (
    FAKE_BIN,
    ROOT,
    Cluster,
    GatewayProc,
    Served,
    serve_one,
    wait_for,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


@pytest.fixture(scope="module")
def seat(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, GatewayProc,
                                                                     Served]]:
    c = Cluster(tmp_path_factory.mktemp("seat"), None, "")
    try:
        gw = c.gateway("gw", local_node="gpu-1", local_gpus="1",
                       vllm_bin=str(FAKE_BIN / "vllm"), log_format="json")
        yield c, gw, serve_one(gw, "chat")
    finally:
        c.close()


def _client(gw: GatewayProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a log, each parsed as JSON (fails on one that is not)."""
    lines = [line for line in text.splitlines() if line.strip()]
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    return out


def _access(gw: GatewayProc, rid: str) -> dict[str, Any]:
    def found() -> list[dict[str, Any]]:
        return [r for r in _json_lines(gw.output())
                if r["logger"] == "app.access" and r.get("request_id") == rid]
    (line,) = wait_for(found, 5, f"the access line of {rid}")
    return line


def _engine_log(c: Cluster, served: Served) -> str:
    return (c.tmp / "gw" / "agent" / "logs" / f"{served.replica['id']}.log").read_text()


def test_health_answers_as_vllm_does_and_the_probes_stay(
        seat: tuple[Cluster, GatewayProc, Served]) -> None:
    _, gw, _ = seat
    r = httpx.get(gw.url + "/health", timeout=5)
    assert (r.status_code, r.content) == (200, b"")
    assert httpx.get(gw.url + "/healthz", timeout=5).json() == {"status": "ok"}
    assert httpx.get(gw.url + "/readyz", timeout=5).status_code == 200


def test_the_clients_request_id_comes_back_reaches_the_engine_and_is_logged(
        seat: tuple[Cluster, GatewayProc, Served]) -> None:
    c, gw, served = seat
    client = _client(gw, served.key)
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "hello"}],
        extra_headers={"X-Request-Id": "client-req-0001"})
    assert raw.request_id == "client-req-0001"
    chat = raw.parse()
    assert chat._request_id == "client-req-0001"
    assert chat.usage is not None
    wait_for(lambda: "Added request client-req-0001 " in _engine_log(c, served), 5,
             "the id in the engine's log")

    line = _access(gw, "client-req-0001")
    assert line["level"] == "INFO" and re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", line["time"])
    assert line["message"] == "POST /v1/chat/completions 200"
    assert line["model"] == "chat" and line["replica"] == served.replica["id"]
    assert line["status"] == 200 and line["key_id"]
    assert line["prompt_tokens"] == chat.usage.prompt_tokens
    assert line["completion_tokens"] == chat.usage.completion_tokens
    assert line["duration"] > 0 and line["ttfb"] is None
    assert served.key not in gw.output()  # the key id, never the key


def test_a_stream_and_an_error_carry_an_id_of_ours_when_the_client_sent_none(
        seat: tuple[Cluster, GatewayProc, Served]) -> None:
    c, gw, served = seat
    client = _client(gw, served.key)
    stream = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "stream please"}], stream=True,
        stream_options={"include_usage": True})
    rid = stream.response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{16}", rid)
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None
    line = _access(gw, rid)  # written after the last byte, the usage counted
    assert line["status"] == 200 and line["completion_tokens"] == usage.completion_tokens
    assert line["prompt_tokens"] == usage.prompt_tokens
    assert 0 < line["ttfb"] <= line["duration"]
    assert f"Added request {rid} " in _engine_log(c, served)

    # Too long, or not printable: replaced by one of ours.
    for bad in ("x" * 129, "caf\u00e9"):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                       headers={"Authorization": f"Bearer {served.key}",
                                "X-Request-Id": bad.encode()},
                       json={"model": "chat", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        assert re.fullmatch(r"[0-9a-f]{16}", r.headers["x-request-id"])

    # Errors too: the SDK's exception names it.
    with pytest.raises(openai.AuthenticationError) as refused:
        _client(gw, "sk-wrong").chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "x"}],
            extra_headers={"X-Request-Id": "bad-key-1"})
    assert refused.value.request_id == "bad-key-1"
    assert _access(gw, "bad-key-1")["status"] == 401
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="nope",
                                       messages=[{"role": "user", "content": "x"}])
    assert unknown.value.request_id
    models = client.models.with_raw_response.list()
    assert models.request_id and _access(gw, models.request_id)["status"] == 200


def test_the_trace_context_reaches_the_engine_unchanged(
        seat: tuple[Cluster, GatewayProc, Served]) -> None:
    c, gw, served = seat
    _client(gw, served.key).completions.create(
        model="chat", prompt="once", max_tokens=3,
        extra_headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE,
                       "X-Request-Id": "traced-1"})
    wait_for(lambda: f"Added request traced-1 traceparent={TRACEPARENT} "
                     f"tracestate={TRACESTATE}" in _engine_log(c, served), 5,
             "the trace context in the engine's log")


def test_every_process_logs_json_lines(seat: tuple[Cluster, GatewayProc, Served]) -> None:
    c, gw, _ = seat
    records = _json_lines(gw.output())  # uvicorn's own lines included
    assert records and {"time", "level", "logger", "message"} <= set(records[0])
    assert any(r["logger"].startswith("uvicorn") for r in records)
    agent = c.agent("node-2", [gw], "--gpus", "1", env_extra={"LLMGW_LOG_FORMAT": "json"})
    wait_for(lambda: any(r["message"].startswith("agent for node node-2")
                         for r in _json_lines(agent.output())), 20, "the agent's start line")
    assert all({"time", "level", "logger", "message"} <= set(r)
               for r in _json_lines(agent.output()))


def test_an_unknown_log_format_is_refused_by_name(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env |= {"LLMGW_LOG_FORMAT": "xml", "LLMGW_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2 and "LLMGW_LOG_FORMAT" in done.stderr, done.stderr
