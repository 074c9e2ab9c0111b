"""A stream that survives its engine, across processes: a gateway, an agent
with three replicas of a model (vLLM stand-ins, 0.1 s a word), the official
`openai` client streaming; the engine serving the stream is SIGKILLed
mid-way. The logic is tested in-process in tests/test_continuation.py.
docs/design/stream-continuation.md."""

from __future__ import annotations

import os
import signal
from typing import Any

import httpx
import openai
import pytest

from tests.support.procs import (
    Cluster,
    GatewayProc,
    engine_pids,
    kill_engine,
    make_key,
    put_model,
    replicas,
    wait_for,
)
from tests.support.scrape import samples, scrape_text

ASKED = " ".join(f"w{i}" for i in range(30))
WHOLE = f"fake-vllm m echo: {ASKED}"  # the stand-in's answer: 33 distinct words


def continuations(gw: GatewayProc, outcome: str) -> float:
    return samples(scrape_text(gw.url)).get(
        ("llmgw_stream_continuations_total", (("model", "m"), ("outcome", outcome))), 0.0)


def requests_counted(gw: GatewayProc, code: int) -> float:
    return samples(scrape_text(gw.url)).get(
        ("llmgw_requests_total", (("code", str(code)), ("model", "m"))), 0.0)


def routed(gw: GatewayProc, count: int) -> dict[str, str]:
    """Replica id -> engine URL of `count` ready replicas the gateway routes to."""
    def ready() -> dict[str, str] | None:
        urls = {r["id"]: r["url"] for r in replicas(gw) if r["phase"] == "ready"}
        with gw.admin() as admin:
            rows = admin.get("/admin/routes", params={"model": "m"}).json()["endpoints"]
        return urls if len(urls) == count and len(rows) == count else None
    found: dict[str, str] = wait_for(ready, 60, f"{count} ready replicas routed")
    return found


def stream(client: openai.OpenAI) -> tuple[str, Any]:
    """A streamed chat: (the replica serving it, the SDK's stream)."""
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": ASKED}], stream=True,
        stream_options={"include_usage": True})
    return raw.headers["x-llmgw-replica"], raw.parse()


def test_a_stream_whose_engine_is_killed_is_read_to_the_end_once_only(
        cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "3", env_extra={"FAKE_VLLM_TOKEN_DELAY": "0.1"})
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1, "replicas": {"min": 3, "max": 3}})
    urls = routed(gw, 3)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)

    # An unbroken stream: what every client must read.
    _, unbroken = stream(client)
    chunks = list(unbroken)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == WHOLE
    usage = chunks[-1].usage

    # A client that leaves: its engine aborts, nothing is continued.
    with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "m", "stream": True,
                            "messages": [{"role": "user", "content": ASKED}]}) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    wait_for(lambda: requests_counted(gw, 499) == 1, 10, "a 499 counted")

    # The engine serving a stream is killed after its fourth word.
    first, broken = stream(client)
    got = []
    for chunk in broken:
        got.append(chunk)
        if len(got) == 5:  # the role and four words
            kill_engine(urls[first])
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == WHOLE
    assert len({c.id for c in got}) == 1
    assert got[-1].usage == usage
    assert continuations(gw, "completed") == 1

    # Once only: the continuation's engine killed too ends the stream with an
    # error, as a stream with no other replica always did.
    first, broken = stream(client)
    words = 0
    with pytest.raises(openai.APIError, match="broke off the stream"):
        for _ in broken:
            words += 1
            if words == 5:
                kill_engine({r["id"]: r["url"] for r in replicas(gw)}[first])
            elif words == 10:  # the one continuing (and any engine of m restarted since)
                for pid in engine_pids("--served-model-name", "m"):
                    os.kill(pid, signal.SIGKILL)
    assert 10 <= words < 33
    assert continuations(gw, "failed") == 1
    assert continuations(gw, "client_gone") == continuations(gw, "no_replica") == 0
    assert requests_counted(gw, 502) == 1 and requests_counted(gw, 200) == 2
