"""All-in-one with the real CPU engine: `llmgw serve` on the embedded store,
its in-process agent starting llama.cpp on SmolLM2, the openai client."""

from __future__ import annotations

import json
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.control.keys import engine_key
from app.wire.engine_routes import PROMPT_TOKENS
from tests.support.llamacpp_real import serve_smollm2
from tests.support.procs import SECRET, Cluster, engine_pid, make_key, wait_for

# SmolLM2's special tokens: <|endoftext|>, <|im_start|>, <|im_end|> (the
# chat template's end of turn). Pushed to -100, the model never stops.
NEVER_STOP = {"0": -100, "1": -100, "2": -100}


def test_smollm2_answers_through_the_all_in_one_gateway(solo: Cluster) -> None:
    gw, rep = serve_smollm2(solo)
    key = make_key(gw)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="small", max_tokens=16,
        messages=[{"role": "user", "content": "Say hello in one word."}],
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="smollm2", max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "Count to three."}],
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()

    # The engine key is in the engine's environment, not its command line;
    # the engine still refuses a request without it; its log is 0600.
    pid = engine_pid(rep["url"])
    ekey = engine_key(SECRET, rep["id"])
    assert ekey.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert httpx.get(rep["url"] + "/v1/models", timeout=10).status_code == 401
    models = httpx.get(rep["url"] + "/v1/models", timeout=10,
                       headers={"Authorization": f"Bearer {ekey}"})
    assert models.status_code == 200
    # Every route of llama-cpp-python's server wants the key, its extras too;
    # FastAPI's API docs stay open (docs/design/security.md, "The engine's port").
    for path in ("/extras/tokenize", "/extras/tokenize/count", "/extras/detokenize"):
        body = {"input": "hello", "tokens": [1]}
        assert httpx.post(rep["url"] + path, json=body, timeout=10).status_code == 401, path
        assert httpx.post(rep["url"] + path, json=body, timeout=10,
                          headers={"Authorization": f"Bearer {ekey}"}).status_code == 200, path
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    assert httpx.post(rep["url"] + PROMPT_TOKENS, json=chat, timeout=10).status_code == 401
    counted = httpx.post(rep["url"] + PROMPT_TOKENS, json=chat, timeout=10,
                         headers={"Authorization": f"Bearer {ekey}"})
    assert counted.status_code == 200 and counted.json()["count"] > 0, counted.text
    spec = httpx.get(rep["url"] + "/openapi.json", timeout=10).json()
    assert set(spec["paths"]) == {
        "/v1/completions", "/v1/embeddings", "/v1/chat/completions", "/v1/models",
        "/extras/tokenize", "/extras/tokenize/count", "/extras/detokenize", PROMPT_TOKENS}
    assert httpx.get(rep["url"] + "/docs", timeout=10).status_code == 200
    log = solo.tmp / "aio" / "agent" / "logs" / f"{rep['id']}.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_a_parameter_llamacpp_refuses_is_a_400_without_its_internals(solo: Cluster) -> None:
    """llama-cpp-python answers 500 with its source file's path for a field
    it does not take (app/router/engine_errors.py): the client gets a 400."""
    gw, _ = serve_smollm2(solo)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=make_key(gw), max_retries=0,
                           timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="small", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "answer", "schema": {"type": "object"}}})
    err = refused.value
    assert err.status_code == 400 and err.param == "response_format.type"
    assert err.request_id and "json_object" in err.message
    text = err.response.text
    assert "site-packages" not in text and "File " not in text, text
    with pytest.raises(openai.BadRequestError) as no_tool:
        client.chat.completions.create(
            model="small", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert no_tool.value.param == "tool_choice"
    # llama-cpp-python's own `grammar` field: a malformed one makes its server
    # process exit, so one client would stop the replica for everyone.
    with pytest.raises(openai.BadRequestError) as grammar:
        client.chat.completions.create(
            model="small", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            extra_body={"grammar": "root ::= nonsense ("})
    assert grammar.value.param == "grammar"
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'llmgw_requests_total{code="400",model="smollm2"} 2.0' in metrics
    assert 'code="500"' not in metrics
    # The replica still serves, a request id of the client's kept by the
    # gateway (llama-cpp-python refuses one that is not a UUID: not sent).
    raw = client.chat.completions.with_raw_response.create(
        model="small", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Request-Id": "client-7"})
    assert raw.http_response.status_code == 200 and raw.request_id == "client-7"


def sse(url: str, key: str, body: dict[str, Any],
        first: threading.Event | None = None) -> dict[str, Any]:
    """Streams one chat completion; what arrived, and when."""
    out: dict[str, Any] = {"status": None, "finish": None, "done": False, "after_done": 0,
                           "tokens": 0, "t0": time.monotonic()}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue  # blank separators and ": ping" comments
            if out["done"]:
                out["after_done"] += 1
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                out["done"] = True
                continue
            for choice in json.loads(data).get("choices", []):
                if choice.get("finish_reason"):
                    out["finish"] = choice["finish_reason"]
                if choice.get("delta", {}).get("content"):
                    out["tokens"] += 1
                    if first is not None:
                        first.set()
    out["seconds"] = time.monotonic() - out["t0"]
    return out


def test_a_long_generation_is_neither_cut_nor_flapped_while_another_stream_waits(
    solo: Cluster,
) -> None:
    gw, _ = serve_smollm2(solo)
    key = make_key(gw)
    # Tokens per second here and now, to size a generation of over 30 s
    # (within the engine's 8192-token context).
    t0 = time.monotonic()
    warm = httpx.post(gw.url + "/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "small", "max_tokens": 200, "logit_bias": NEVER_STOP,
                            "messages": [{"role": "user", "content": "Tell a story."}]})
    assert warm.status_code == 200, warm.text
    rate = warm.json()["usage"]["completion_tokens"] / (time.monotonic() - t0)
    long_tokens = min(8000, int(rate * 40))  # margin: the rate measured may be a loaded moment's
    print(f"llama.cpp here: {rate:.0f} tokens/s; long stream: {long_tokens} tokens")

    phases: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        with gw.admin() as admin:
            while not stop.is_set():
                phases.extend(r["phase"] for r in admin.get("/admin/replicas").json())
                time.sleep(0.25)

    first = threading.Event()
    long_body = {"model": "smollm2", "stream": True, "max_tokens": long_tokens,
                 "logit_bias": NEVER_STOP,
                 "messages": [{"role": "user", "content": "Tell a very long story."}]}
    short_body = {"model": "small", "stream": True, "max_tokens": 16,
                  "messages": [{"role": "user", "content": "Say hello."}]}
    with ThreadPoolExecutor(3) as pool:
        watcher = pool.submit(watch)
        try:
            long = pool.submit(sse, gw.url, key, long_body, first)
            assert first.wait(60), "the long stream never started"
            short = pool.submit(sse, gw.url, key, short_body)  # waits for the model's lock
            results = long.result(timeout=200), short.result(timeout=60)
        finally:
            stop.set()
        watcher.result(timeout=30)
    long_run, short_run = results
    print(f"long stream: {long_run['tokens']} tokens in {long_run['seconds']:.1f} s; "
          f"short stream done after {short_run['seconds']:.1f} s")
    for run in results:
        assert run["status"] == 200  # no 503: the replica stayed routable
        assert run["done"] and run["after_done"] == 0, run  # ends with [DONE]
    # Neither was cut short: each ends with its reason, the long one at its limit.
    assert long_run["finish"] == "length" and long_run["tokens"] >= long_tokens - 1, long_run
    assert short_run["finish"] in ("stop", "length") and short_run["tokens"] > 0, short_run
    assert long_run["seconds"] >= 30, long_run
    assert phases and set(phases) == {"ready"}, sorted(set(phases))


def test_a_stream_is_charged_the_tokens_the_engine_counts_unstreamed(solo: Cluster) -> None:
    # llama-cpp-python's streams carry no usage: the gateway counts their
    # completion tokens from the events and has the engine count the
    # prompt after the stream (docs/design/security.md).
    gw, _ = serve_smollm2(solo, key_usage_interval="0.2")
    reference, streaming = make_key(gw, "reference"), make_key(gw, "streaming")
    with gw.admin() as admin:
        key_id = next(k["id"] for k in admin.get("/admin/keys").json()
                      if k["name"] == "streaming")
    asks: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"model": "small", "max_tokens": 24, "temperature": 0,
                                  "logit_bias": NEVER_STOP, "messages": [
                                      {"role": "system", "content": "You answer briefly."},
                                      {"role": "user", "content": "Name three rivers."}]}),
        ("/v1/completions", {"model": "small", "max_tokens": 17, "temperature": 0,
                             "logit_bias": NEVER_STOP,
                             "prompt": "The three longest rivers of Europe are"}),
    ]
    want = {"prompt_tokens": 0, "completion_tokens": 0}
    for path, body in asks:
        plain = httpx.post(gw.url + path, json=body, timeout=120,
                           headers={"Authorization": f"Bearer {reference}"})
        assert plain.status_code == 200, plain.text
        for field in want:
            want[field] += plain.json()["usage"][field]
        with httpx.stream("POST", gw.url + path, json=body | {"stream": True}, timeout=120,
                          headers={"Authorization": f"Bearer {streaming}"}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"usage"' in e for e in events)
    print(f"engine's own counts: {want}")

    def usage() -> dict[str, Any] | None:
        with gw.admin() as admin:
            total: dict[str, Any] = admin.get(f"/admin/keys/{key_id}/usage").json()["total"]
        # Completion tokens are charged as a stream ends, its prompt once counted.
        if total["requests"] == 2 and (total["estimated"]
                                       or total["prompt_tokens"] >= want["prompt_tokens"]):
            return total
        return None

    got = wait_for(usage, 60, "the streams' prompts counted")
    assert got == {"requests": 2, "estimated": 0} | want


def test_a_stream_that_asks_for_usage_gets_it_as_from_vllm(solo: Cluster) -> None:
    """`stream_options.include_usage` on the llama.cpp engine, which never
    sends a usage event: the client gets one before [DONE], in OpenAI's
    shape, with what the engine counts unstreamed and its key is charged.
    The engine counts the chat's prompt at the route our agent adds to it,
    without running the chat again (its access log: two chats, one count)."""
    gw, rep = serve_smollm2(solo, key_usage_interval="0.2")
    key = make_key(gw, "streaming")
    with gw.admin() as admin:
        key_id = next(k["id"] for k in admin.get("/admin/keys").json()
                      if k["name"] == "streaming")
    body: dict[str, Any] = {
        "model": "small", "max_tokens": 24, "temperature": 0, "logit_bias": NEVER_STOP,
        "messages": [{"role": "system", "content": "You answer briefly."},
                     {"role": "user", "content": "Name three rivers."}]}
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)
    plain = client.chat.completions.create(**body)  # the engine's own count
    assert plain.usage is not None
    chunks = list(client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}))
    *text, last = chunks
    assert all(c.usage is None for c in text) and last.choices == [], chunks[-3:]
    assert last.usage is not None and last.id == text[0].id
    got = (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens)
    want = plain.usage.prompt_tokens, plain.usage.completion_tokens
    assert got == (*want, sum(want)), (got, want)

    def charged() -> dict[str, Any] | None:
        with gw.admin() as admin:
            total: dict[str, Any] = admin.get(f"/admin/keys/{key_id}/usage").json()["total"]
        return total if total["requests"] == 2 else None

    assert wait_for(charged, 30, "the key's usage written") == {
        "requests": 2, "estimated": 0, "prompt_tokens": 2 * want[0],
        "completion_tokens": 2 * want[1]}
    with gw.admin() as admin:
        r = admin.get(f"/admin/nodes/{rep['node']}/logs",
                      params={"source": rep["id"], "lines": 500})
    assert r.status_code == 200, r.text
    posts = [line.split('"POST ', 1)[1].split(" ", 1)[0] for line in r.json()["lines"]
             if '"POST ' in line]
    assert posts == ["/v1/chat/completions", "/v1/chat/completions", PROMPT_TOKENS], posts


def test_the_responses_api_on_llamacpp_is_an_openai_error_that_says_so(solo: Cluster) -> None:
    gw, _ = serve_smollm2(solo)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=make_key(gw), max_retries=0,
                           timeout=60)
    with pytest.raises(openai.NotFoundError) as refused:
        client.responses.create(model="small", input="Say hello.")
    err = refused.value
    assert err.code == "unsupported_endpoint" and err.param == "model", err.body
    assert "Responses API" in err.message and "llama.cpp" in err.message, err.message
    assert err.request_id
    # The replica was not blamed: it still answers.
    chat = client.chat.completions.create(
        model="small", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content is not None
